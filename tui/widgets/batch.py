"""Batch panel: a watched `macfleet serve`'s continuous batch (``dash --serve URL``).

Per iteration (the last ones the server reports): sessions in the forward, decode vs prefill
tokens, queue length, forward time; per session: state, TTFT and inter-token latency p50/p99.
The lines and cells are pure functions of the ``ServeView``; the widget only places them.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from macfleet.fleet.batch import BatchView, IterationView, ServedSession, ServeView
from tui.format import DASH, clip, fmt_ms
from tui.widgets.table import sync_rows

MAX_SESSION_ROWS = 32  # the server reports live sessions and its last ended ones
STATE_STYLES = {"queued": "yellow", "prefill": "cyan", "decode": "green", "done": "dim",
                "cancelled": "dim yellow", "failed": "bold red"}


def batch_title(view: ServeView) -> str:
    """``Batch · 127.0.0.1:8000 · up``: which server, and whether it can serve."""
    where = view.url.removeprefix("http://").removesuffix("/").removesuffix("/v1")
    return f"Batch · {clip(where, 40)} · {view.state}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def load_line(b: BatchView) -> str:
    """``3 active · 1 queued · 1204 iterations · smollm2``."""
    its = (f"{b.iterations} iterations" if b.mode == "batched"
           else f"{b.iterations} iterations on the verifier agent" if b.iterations
           else "on the verifier agent (one session at a time)")
    return f"{b.active} active · {b.waiting} queued · {its} · {b.model}"


def iteration_lines(recent: Sequence[IterationView]) -> tuple[str, ...]:
    """Means (and maxima) per iteration over ``recent``: who shares a forward, how many of
    its tokens are decode blocks and how many prefill chunks, and what waited."""
    if not recent:
        return ("no iterations yet",)
    ses = [r.sessions for r in recent]
    dec = [r.decode_tokens for r in recent]
    pre = [r.prefill_tokens for r in recent]
    que = [r.queued for r in recent]
    ms = [r.ms for r in recent]
    return (f"per iteration, last {len(recent)}: {_mean(ses):.1f} sessions (max {max(ses)})"
            f" · {fmt_ms(_mean(ms))} ms (max {fmt_ms(max(ms))})",
            f"tokens: decode {_mean(dec):.1f} (max {max(dec)}) · prefill {_mean(pre):.1f} "
            f"(max {max(pre)}) · queue {_mean(que):.1f} (max {max(que)})")


def session_cells(s: ServedSession) -> list[Text]:
    """State, progress, TTFT and ITL p50/p99 (ms), draft acceptance."""
    state = (f"prefill {s.prefill_left}" if s.state == "prefill" and s.prefill_left else s.state)
    acc = f"{100 * s.accepted / s.drafted:.0f}%" if s.drafted else DASH
    style = "" if s.active else "dim"
    cells = [Text(str(s.sid), style), Text(clip(state, 12), STATE_STYLES.get(s.state, "")),
             *(Text(c, style) for c in (str(s.prompt_tokens), str(s.generated),
                                         fmt_ms(s.ttft_ms), fmt_ms(s.itl_p50_ms),
                                         fmt_ms(s.itl_p99_ms), acc))]
    return cells


def ordered_sessions(sessions: Sequence[ServedSession]) -> list[ServedSession]:
    """Live sessions first (oldest first), then ended ones (newest first), capped."""
    live = sorted((s for s in sessions if s.active), key=lambda s: s.sid)
    ended = sorted((s for s in sessions if not s.active), key=lambda s: -s.sid)
    return (live + ended)[:MAX_SESSION_ROWS]


class BatchPanel(Vertical):
    """Hidden until a snapshot carries a watched server."""

    def compose(self) -> ComposeResult:
        yield Static("", id="batch-summary")
        yield DataTable(id="batch-sessions-table", cursor_type="row", show_cursor=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("sid", "state", "prompt", "gen", "TTFT",
                                              "ITL p50", "p99", "acc")
        self.show(None)

    def show(self, view: ServeView | None) -> None:
        self.display = view is not None
        if view is None:
            return
        self.border_title = batch_title(view)
        summary = self.query_one("#batch-summary", Static)
        table = self.query_one(DataTable)
        b = view.batch
        if b is None:
            summary.update(Text(f"down: {view.error}", "bold red"))
            table.display = False
            return
        text = Text()
        if not b.alive:
            text.append("no verifier: requests are answered 503\n", "bold red")
        lines = [load_line(b), *(iteration_lines(b.recent) if b.mode == "batched" else ())]
        text.append("\n".join(lines))
        summary.update(text)
        rows = ordered_sessions(b.sessions)
        sync_rows(table, [(str(s.sid), session_cells(s)) for s in rows])
        table.display = bool(rows)
        self.border_subtitle = "latencies in ms" if rows else ""
