"""The fleet dashboard: an observer of ``FleetSnapshot``s delivered by a ``SnapshotSource``.

Data flow (STYLE.md, Textual): a thread worker polls the source and posts
``SnapshotArrived``; the app applies a snapshot by calling ``show(...)`` on each panel.
Widgets never do I/O, so a stalled or broken source can freeze the numbers but never the UI.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer
from textual.worker import Worker, WorkerState, get_current_worker

from macfleet.fleet.snapshot import (EMPTY_SNAPSHOT, FleetEvent, FleetSnapshot, SessionView,
                                     SnapshotSource)
from tui.messages import SnapshotArrived
from tui.screens.session_detail import SessionDetailScreen
from tui.widgets import (HOST_SORTS, AcceptHistogram, BatchPanel, EventLog, FlowsPanel, HostsPanel,
                         LinksPanel, SessionsPanel, StatusBar)

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 1.0
STALL_PERIODS = 3  # refresh periods without a snapshot before the stream counts as stalled
STALL_CHECK_MAX_S = 0.25


class FleetDashboard(App[None]):
    """Hosts, links, sessions, per-flow multi-host overhead and events of one fleet; the
    batch of a watched `macfleet serve` on top when the snapshots carry one."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "macfleet"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("s", "cycle_sort", "Sort hosts"),
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall")]
    AUTO_FOCUS = "#sessions-table"

    paused: reactive[bool] = reactive(False, init=False)
    host_sort: reactive[str] = reactive("name", init=False)

    def __init__(self, source: SnapshotSource, refresh_s: float = DEFAULT_REFRESH_S, *,
                 stall_after_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be positive, got {refresh_s}")
        self.source = source
        self.refresh_s = refresh_s
        self.stall_after_s = STALL_PERIODS * refresh_s if stall_after_s is None else stall_after_s
        self._clock = clock
        self.snapshot: FleetSnapshot = EMPTY_SNAPSHOT  # the one on screen
        self.pending: FleetSnapshot | None = None  # arrived while paused
        self.received = 0
        self.selected_session: str | None = None
        self._last_arrival = clock()
        self._stop = threading.Event()

    # -- layout -------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        self.status_bar = StatusBar(id="status")
        self.hosts = HostsPanel(id="hosts", classes="panel")
        self.sessions = SessionsPanel(id="sessions", classes="panel")
        self.links = LinksPanel(id="links", classes="panel")
        self.flows = FlowsPanel(id="flows", classes="panel")
        self.events = EventLog(id="events", classes="panel")
        self.accept_hist = AcceptHistogram(id="accept-hist")
        self.batch_panel = BatchPanel(id="batch", classes="panel")  # with dash --serve only
        yield self.status_bar
        yield self.batch_panel
        yield self.hosts
        with Horizontal(id="middle"):
            yield self.sessions
            yield self.links
        with Horizontal(id="bottom"):
            with Vertical(id="bottom-left"):
                yield self.flows
                with Vertical(id="accept", classes="panel"):  # shown on tall screens only
                    yield self.accept_hist
            yield self.events
        yield Footer()

    def on_mount(self) -> None:
        self._last_arrival = self._clock()
        # a cheap comparison, so check more often than we poll: the notice shows promptly
        self.set_interval(min(self.refresh_s, STALL_CHECK_MAX_S), self._check_stall,
                          name="stall-check")
        self.run_worker(self._poll_loop, name="snapshot-poll", group="source", thread=True,
                        exclusive=True, exit_on_error=False)

    def on_unmount(self) -> None:
        self._stop.set()
        self.source.close()  # wakes a poll() blocked in the worker thread

    # -- the worker (runs in a thread) --------------------------------------------------
    def _poll_loop(self) -> None:
        """Poll the source at most once per refresh period; only post, never touch widgets."""
        worker = get_current_worker()
        try:
            while not worker.is_cancelled and not self._stop.is_set():
                started = time.monotonic()
                snapshot = self.source.poll(timeout_s=self.refresh_s)
                if snapshot is not None and not worker.is_cancelled:
                    self.post_message(SnapshotArrived(snapshot))
                self._stop.wait(max(0.0, self.refresh_s - (time.monotonic() - started)))
        finally:
            self.source.close()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "source" and event.state == WorkerState.ERROR:
            err = event.worker.error
            log.error("snapshot source failed: %r", err)
            self.status_bar.error = f"metrics source failed: {err!r}"[:120]
            self.events.add_events([FleetEvent(self._clock(), "error",
                                               f"metrics source failed: {err!r}")])

    # -- applying snapshots -------------------------------------------------------------
    def on_snapshot_arrived(self, message: SnapshotArrived) -> None:
        self.received += 1
        self._last_arrival = self._clock()
        if self.status_bar.stalled_since is not None:
            self.status_bar.stalled_since = None
            self._local_event("session", "metrics stream resumed")
        if self.paused:
            self.pending = message.snapshot
        else:
            self.apply_snapshot(message.snapshot)

    def apply_snapshot(self, snapshot: FleetSnapshot) -> None:
        """Show ``snapshot`` in every panel (and in an open session detail screen)."""
        self.snapshot = snapshot
        self.batch_panel.show(snapshot.serve)
        self.hosts.show(snapshot.hosts, self.host_sort)
        self.links.show(snapshot.links)
        self.sessions.show(snapshot.sessions)
        self._show_focus_session()
        self.events.add_events(snapshot.events)
        dead = sum(not h.alive for h in snapshot.hosts)
        active = sum(s.active for s in snapshot.sessions)
        self.status_bar.fleet_id = snapshot.fleet_id
        self.status_bar.summary = (_plural(len(snapshot.hosts), "host")
                                   + (f" ({dead} dead)" if dead else "")
                                   + f" · {_plural(active, 'active session')}")
        self.status_bar.taken_at = snapshot.taken_at or None
        for screen in self.screen_stack:
            if isinstance(screen, SessionDetailScreen):
                screen.show(snapshot)

    def focus_session(self) -> SessionView | None:
        """The session whose flows are shown: the highlighted one, else first active."""
        sessions = self.snapshot.sessions
        chosen = next((s for s in sessions if s.session_id == self.selected_session), None)
        return chosen or next((s for s in sessions if s.active), None) or \
            (sessions[0] if sessions else None)

    def _show_focus_session(self) -> None:
        session = self.focus_session()
        self.flows.show(session)
        self.accept_hist.hist = session.accepted_hist if session else ()
        box = self.query_one("#accept")
        box.border_title = ("Accepted tokens per block"
                            + (f" · {session.session_id}" if session else ""))

    def _check_stall(self) -> None:
        if self.status_bar.stalled_since is not None:
            return
        if self._clock() - self._last_arrival > self.stall_after_s:
            self.status_bar.stalled_since = self._last_arrival
            self._local_event("error", "metrics stream stalled")

    def _local_event(self, kind: str, text: str) -> None:
        self.events.add_events([FleetEvent(self._clock(), kind, text)])

    # -- user actions -------------------------------------------------------------------
    def on_sessions_panel_highlighted(self, message: SessionsPanel.Highlighted) -> None:
        self.selected_session = message.session_id
        self._show_focus_session()

    def on_sessions_panel_opened(self, message: SessionsPanel.Opened) -> None:
        self.push_screen(SessionDetailScreen(message.session_id, self.snapshot))

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def watch_paused(self, paused: bool) -> None:
        self.status_bar.paused = paused
        if not paused and self.pending is not None:
            snapshot, self.pending = self.pending, None
            self.apply_snapshot(snapshot)

    def action_cycle_sort(self) -> None:
        self.host_sort = HOST_SORTS[(HOST_SORTS.index(self.host_sort) + 1) % len(HOST_SORTS)]

    def watch_host_sort(self, sort: str) -> None:
        self.hosts.show(self.snapshot.hosts, sort)  # re-sort what is on screen, even paused


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def run_dashboard(source: SnapshotSource, refresh_s: float = DEFAULT_REFRESH_S) -> None:
    """Run the dashboard in this terminal until the user quits; closes ``source``."""
    try:
        FleetDashboard(source, refresh_s=refresh_s).run()
    finally:
        source.close()
