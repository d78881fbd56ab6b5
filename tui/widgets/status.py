"""One-line status bar: alarms (PAUSED, stalled stream) first, then fleet summary."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from tui.format import fmt_clock


class StatusBar(Static):
    """Shows what state the *dashboard* is in, so a frozen screen is never mistaken for a
    quiet fleet: alarms come first so an 80-column terminal never truncates them."""

    fleet_id: reactive[str] = reactive("")
    summary: reactive[str] = reactive("")
    taken_at: reactive[float | None] = reactive(None)
    paused: reactive[bool] = reactive(False)
    stalled_since: reactive[float | None] = reactive(None)
    error: reactive[str] = reactive("")

    def render(self) -> Text:
        text = Text()
        if self.paused:
            text.append(" PAUSED ", "bold black on yellow")
            text.append(" ")
        if self.error:
            text.append(f" {self.error} ", "bold white on red")
            text.append(" ")
        elif self.stalled_since is not None:
            text.append(f" metrics stream stalled since {fmt_clock(self.stalled_since)} ",
                        "bold white on red")
            text.append(" ")
        text.append("macfleet", "bold")
        if self.fleet_id:
            text.append(f" · {self.fleet_id}")
        if self.summary:
            text.append(f" · {self.summary}")
        if self.taken_at:
            text.append(f" · at {fmt_clock(self.taken_at)}", "dim")
        return text

    @property
    def plain(self) -> str:
        """The bar as plain text (what tests and screen readers look at)."""
        return self.render().plain
