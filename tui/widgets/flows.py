"""Multi-host overhead panel: per flow bytes/block, ms/block, share of block, sparkline."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from macfleet.fleet.snapshot import FLOW_NAMES, FlowView, SessionView
from tui.format import clip, fmt_bytes, fmt_ms, fmt_pct

HEADER = f"{'flow':<9}{'bytes/blk':>10}{'ms/blk':>8}{'%block':>8}  history (ms/blk)"


def _flow_order(f: FlowView) -> tuple[int, str]:
    return (FLOW_NAMES.index(f.flow) if f.flow in FLOW_NAMES else len(FLOW_NAMES), f.flow)


class FlowRow(Horizontal):
    """One flow: numbers plus a sparkline of its recent ms/block."""

    def __init__(self, flow: FlowView) -> None:
        super().__init__(classes="flow-row")
        self.flow = flow
        # held, not queried: a row can get its next update before it has composed
        self._name = Label(classes="flow-name")
        self._nums = Label(classes="flow-nums")
        self._spark = Sparkline(classes="flow-spark")

    def compose(self) -> ComposeResult:
        yield self._name
        yield self._nums
        yield self._spark

    def on_mount(self) -> None:
        self._render_flow()

    def show(self, f: FlowView) -> None:
        self.flow = f
        if self.is_mounted:
            self._render_flow()  # else on_mount renders the latest

    def _render_flow(self) -> None:
        f = self.flow
        # F3 is often only *probed* (bench-sized payloads, no EAGLE drafter consuming it):
        # say so, or its MBs/block read as overhead the session is actually paying.
        self.set_class(f.probe or f.estimate, "-probe")
        self._name.update(clip(f.label, 9))
        nums = f"{fmt_bytes(f.bytes_per_block):>10}{fmt_ms(f.ms_per_block):>8}"
        self._nums.update(nums + f"{fmt_pct(f.share_of_block):>8}")
        self._spark.data = list(f.history)


def compute_summary(s: SessionView) -> str:
    """Where a block's time goes, from the session's recent timeline, to set the flows'
    wire time beside the compute time it competes with."""
    load = ("\nrouter load per rank " + " / ".join(f"{x:,}" for x in s.rank_load)
            + " tokens" if s.rank_load else "")
    if s.ahead is not None:  # a draft-model agent drafting ahead of the verifier
        load += (f"\ndraft agent ahead by {s.ahead[0]:.1f} drafts a block, "
                 f"{fmt_pct(s.ahead[1])} of its drafts thrown away")
    if not s.timeline:
        return f"overhead {fmt_pct(s.overhead_share)} of block time" + load
    tl = s.timeline
    return (f"block {fmt_ms(fmean(b.block_ms for b in tl))}ms = "
            f"verify {fmt_ms(fmean(b.verify_ms for b in tl))} + "
            f"draft {fmt_ms(fmean(b.draft_ms for b in tl))} + "
            f"wire {fmt_ms(fmean(b.wire_ms for b in tl))}  "
            f"(overhead {fmt_pct(s.overhead_share)})" + load)


class FlowsPanel(Vertical):
    """Overhead of going multi-host for one session (the selected or first active one)."""

    def compose(self) -> ComposeResult:
        yield Static(HEADER, id="flows-header")
        yield Vertical(id="flow-rows")
        yield Static("", id="flows-summary")
        yield Static("no active session", id="flows-empty", classes="empty")

    def on_mount(self) -> None:
        self.show(None)

    def show(self, session: SessionView | None) -> None:
        flows: Sequence[FlowView] = sorted(session.flows, key=_flow_order) if session else ()
        self._sync_rows(flows)
        has = session is not None
        for wid in ("#flows-header", "#flow-rows", "#flows-summary"):
            self.query_one(wid).display = has
        self.query_one("#flows-empty").display = not has
        if session is None:
            self.border_title = "Multi-host overhead"
            return
        self.border_title = f"Multi-host overhead · {clip(session.session_id, 12)}"
        self.query_one("#flows-summary", Static).update(compute_summary(session))

    def _sync_rows(self, flows: Sequence[FlowView]) -> None:
        """Keep one FlowRow per flow name: update in place, mount new, drop vanished."""
        box = self.query_one("#flow-rows", Vertical)
        existing = {row.flow.flow: row for row in box.query(FlowRow)}
        wanted = [f.flow for f in flows]
        if list(existing) != wanted:
            box.remove_children()
            box.mount_all(FlowRow(f) for f in flows)
            return
        for f in flows:
            existing[f.flow].show(f)

    def flow_names(self) -> list[str]:
        """Displayed flow labels in order (what a user reads in the first column)."""
        return [r.flow.label for r in self.query_one("#flow-rows").query(FlowRow)]
