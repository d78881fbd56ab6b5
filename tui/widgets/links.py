"""Links panel: round-trip latency between host pairs (p50 / p95)."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from macfleet.fleet.snapshot import LinkView
from tui.format import clip, fmt_ms
from tui.widgets.table import sync_rows


class LinksPanel(Vertical):
    """Link latencies: the cost every flow pays at least once per block."""

    def compose(self) -> ComposeResult:
        yield DataTable(id="links-table", cursor_type="row", show_cursor=False)
        yield Static("no links measured", id="links-empty", classes="empty")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("link", "p50", "p95")
        self.border_title = "Links (ms)"
        self.show([])

    def show(self, links: Sequence[LinkView]) -> None:
        ordered = sorted(links, key=lambda x: (x.src, x.dst))
        rows = [(f"{x.src}>{x.dst}",
                 [clip(f"{x.src}→{x.dst}", 20), fmt_ms(x.rtt_p50_ms), fmt_ms(x.rtt_p95_ms)])
                for x in ordered]
        table = self.query_one(DataTable)
        sync_rows(table, rows)
        table.display = bool(rows)
        self.query_one("#links-empty").display = not rows
