"""Event log: joins, leaves, heartbeat losses, errors, sessions, and the dashboard's own."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from rich.text import Text
from textual.widgets import RichLog

from macfleet.fleet.snapshot import FleetEvent
from tui.format import fmt_clock

KIND_STYLES = {
    "join": "green", "leave": "yellow", "heartbeat_lost": "bold red",
    "heartbeat_back": "green", "error": "bold red", "session": "cyan",
}
KIND_LABELS = {"heartbeat_lost": "hb lost", "heartbeat_back": "hb back"}
_SEEN_MAX = 2000


class EventLog(RichLog):
    """Append-only log fed with each snapshot's window of recent events.

    Snapshots repeat recent events, so every event value is remembered (bounded) and
    written once; events older than the newest already written are also skipped, since a
    log that inserts out of order is harder to read than one that drops a late straggler.
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_lines=500, wrap=True, min_width=20, markup=False, auto_scroll=True,
                         **kwargs)  # type: ignore[arg-type]
        self._seen: set[FleetEvent] = set()
        self._order: deque[FleetEvent] = deque()
        self._newest = float("-inf")
        self.written: list[FleetEvent] = []  # what was shown, for tests and debugging
        self._lines: deque[Text] = deque(maxlen=500)
        self._wrap_width = 0

    def on_mount(self) -> None:
        self.border_title = "Events"

    def add_events(self, events: Iterable[FleetEvent]) -> int:
        """Write the events not shown before, oldest first; returns how many were new."""
        fresh = sorted((e for e in events if e not in self._seen and e.t >= self._newest),
                       key=lambda e: e.t)
        for event in fresh:
            self._remember(event)
            line = Text(f"{fmt_clock(event.t)} ", "dim")
            label = KIND_LABELS.get(event.kind, event.kind)
            line.append(f"{label:<8}", KIND_STYLES.get(event.kind, ""))
            line.append(event.text)
            self._lines.append(line)
            self.write(line)
            self.written.append(event)
            del self.written[:-_SEEN_MAX]
        return len(fresh)

    def on_resize(self) -> None:
        """RichLog wraps a line once, at the width it had when written; lines written
        before the layout settled (or before a terminal resize) are re-wrapped here."""
        width = self.scrollable_content_region.width
        if width != self._wrap_width and self._lines:
            self.clear()
            for line in self._lines:
                self.write(line)
        self._wrap_width = width

    def _remember(self, event: FleetEvent) -> None:
        self._seen.add(event)
        self._order.append(event)
        self._newest = max(self._newest, event.t)
        while len(self._order) > _SEEN_MAX:
            self._seen.discard(self._order.popleft())
