"""Detail of one session: accepted-length histogram and per-block timeline."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from macfleet.fleet.snapshot import BlockSample, FleetSnapshot, SessionView
from macfleet.stats import multihost_overhead
from tui.format import fmt_ms, fmt_pct
from tui.widgets.histogram import AcceptHistogram
from tui.widgets.table import sync_rows

TIMELINE_ROWS = 200  # newest first; older blocks are in the recording, not on screen


def summary_text(s: SessionView) -> Text:
    text = Text()
    text.append(f"session {s.session_id}", "bold")
    text.append("  active" if s.active else "  finished", "green" if s.active else "dim")
    text.append(f"\nverifier {s.verifier} · proposers {', '.join(s.proposers) or '—'}"
                f" · {s.topology}")
    text.append(f"\n{s.tokens_per_s:.1f} tok/s · acceptance {fmt_pct(s.acceptance)} · "
                f"mean accepted {s.mean_accepted:.2f} · k={s.draft_len} · {s.blocks} blocks · "
                f"overhead {fmt_pct(s.overhead_share)}")
    if s.drafters:
        text.append(f"\n{drafting_text(s)}")
    return text


def drafting_text(s: SessionView) -> str:
    """`auto`'s choice: the latest block's candidate and why, every candidate's share."""
    tried = sum(d.explored for d in s.drafters)
    shares = " · ".join(f"{d.name} {fmt_pct(s.drafter_share(d.name))}" for d in s.drafters)
    return (f"auto drafting {s.drafter or '—'} ({s.why or '—'}) · {shares}"
            + (f" · {tried} tried" if tried else ""))


def block_cells(b: BlockSample) -> list[str]:
    wire = multihost_overhead(b.wire_ms, b.block_ms)  # this one block's
    return [str(b.block), f"{b.accepted}/{b.k}", fmt_ms(b.block_ms), fmt_ms(b.draft_ms),
            fmt_ms(b.verify_ms), fmt_ms(b.wire_ms), fmt_pct(wire)]


class SessionDetailScreen(Screen[None]):
    """Pushed on enter over a session row; follows live snapshots until escape."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, session_id: str, snapshot: FleetSnapshot) -> None:
        super().__init__()
        self.session_id = session_id
        self._snapshot = snapshot

    def compose(self) -> ComposeResult:
        yield Static(id="detail-summary")
        with Horizontal(id="detail-body"):
            with Vertical(id="detail-hist-box"):
                yield AcceptHistogram(id="detail-hist")
            yield DataTable(id="detail-timeline", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#detail-hist-box").border_title = "Accepted tokens per block"
        table = self.query_one("#detail-timeline", DataTable)
        table.add_columns("#", "acc/k", "total", "draft", "verify", "wire", "wire%")
        table.border_title = "Timeline (ms, newest first)"
        self.show(self._snapshot)

    @property
    def session(self) -> SessionView | None:
        return next((s for s in self._snapshot.sessions if s.session_id == self.session_id),
                    None)

    def show(self, snapshot: FleetSnapshot) -> None:
        """Follow a newer snapshot; a session that stopped being reported says so."""
        self._snapshot = snapshot
        s = self.session
        summary = self.query_one("#detail-summary", Static)
        if s is None:
            summary.update(Text(f"session {self.session_id}: no longer reported by the fleet",
                                "bold yellow"))
            return
        summary.update(summary_text(s))
        self.query_one(AcceptHistogram).hist = s.accepted_hist
        newest = sorted(s.timeline, key=lambda b: -b.block)[:TIMELINE_ROWS]
        sync_rows(self.query_one("#detail-timeline", DataTable),
                  [(str(b.block), block_cells(b)) for b in newest])
