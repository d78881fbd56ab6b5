"""Sessions panel: one row per decoding session; highlighting one picks the flows shown."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Static

from macfleet.fleet.snapshot import SessionView
from tui.format import clip
from tui.widgets.table import sync_rows


def session_cells(s: SessionView) -> list[Text]:
    """Speed, acceptance and draft length: what tells whether speculation is paying."""
    style = "" if s.active else "dim"
    cells = [clip(s.session_id, 8), clip(s.verifier, 10), clip(s.topology, 10),
             f"{s.tokens_per_s:.1f}", f"{100 * s.acceptance:.0f}%", f"{s.mean_accepted:.2f}",
             str(s.draft_len)]
    return [Text(c, style) for c in cells]


class SessionsPanel(Vertical):
    """Table of sessions; posts ``Highlighted`` on cursor moves and ``Opened`` on enter."""

    class Highlighted(Message):
        def __init__(self, session_id: str) -> None:
            super().__init__()
            self.session_id = session_id

    class Opened(Message):
        def __init__(self, session_id: str) -> None:
            super().__init__()
            self.session_id = session_id

    def compose(self) -> ComposeResult:
        yield DataTable(id="sessions-table", cursor_type="row")
        yield Static("no sessions", id="sessions-empty", classes="empty")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("session", "verifier", "topology", "tok/s", "acc", "mean", "k")
        self.border_title = "Sessions"
        self.show([])

    def show(self, sessions: Sequence[SessionView]) -> None:
        # active sessions first: they are what someone watching the dashboard came for
        ordered = sorted(sessions, key=lambda s: (not s.active, s.session_id))
        table = self.query_one(DataTable)
        sync_rows(table, [(s.session_id, session_cells(s)) for s in ordered])
        table.display = bool(ordered)
        self.query_one("#sessions-empty").display = not ordered
        if ordered and self.screen.focused is None:
            table.focus()  # it was hidden when the screen picked its first focus
        active = sum(s.active for s in sessions)
        # the table's enter binding is hidden from the footer, so say it here
        self.border_title = (f"Sessions ({active} active) · enter: detail" if sessions
                             else "Sessions")

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if event.row_key.value is not None:
            self.post_message(self.Highlighted(str(event.row_key.value)))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key.value is not None:
            self.post_message(self.Opened(str(event.row_key.value)))
