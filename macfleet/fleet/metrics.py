"""Pure aggregation of per-block metrics into dashboard session views.

`SessionMetrics.apply(block_metrics)` folds one BlockMetrics message in; `view()` reduces the
recent window to a SessionView: tokens/s, acceptance, the accepted-length histogram, and the
multi-host overhead per flow (bytes/block, ms/block, share of block time, with history).
The overhead and each flow's share of it are `macfleet.stats.multihost_overhead` of the window's
blocks, the figure `macfleet generate` prints for the same blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from macfleet.fleet.snapshot import BlockSample, DrafterShare, FlowView, SessionView
from macfleet.stats import EXPLORE, multihost_overhead

DEFAULT_WINDOW = 32
DEFAULT_HISTORY = 40
ACTIVE_S = 5.0


@dataclass
class SessionMetrics:
    session_id: str
    verifier: str
    window: int = DEFAULT_WINDOW
    blocks: deque = field(default_factory=lambda: deque(maxlen=DEFAULT_WINDOW))
    hist: list[int] = field(default_factory=lambda: [0] * 33)
    total_blocks: int = 0
    last_seen: float = 0.0
    proposers: tuple[str, ...] = ()
    history: dict[str, deque] = field(default_factory=dict)
    kv: tuple[int, float] | None = None  # flow KV of this session's prompt: (bytes, ms)
    # `--proposer auto`: blocks and tries by candidate over the whole session
    drafters: dict[str, list[int]] = field(default_factory=dict)

    def apply(self, m, now: float) -> None:
        """m: a bridge BlockMetrics (duck-typed: the fields are read by name)."""
        self.blocks.append(m)
        self.total_blocks += 1
        self.last_seen = now
        if getattr(m, "kv_bytes", 0):
            self.kv = (int(m.kv_bytes), float(m.kv_ms))
        if m.k > 0:
            self.hist[min(m.accepted, len(self.hist) - 1)] += 1
        if getattr(m, "drafter", ""):
            t = self.drafters.setdefault(m.drafter, [0, 0])
            t[0] += 1
            t[1] += getattr(m, "why", "") == EXPLORE
        for flow, ms in (("F1", m.f1_ms), ("F2", m.f2_ms), ("F3", m.f3_ms),
                         ("shard", getattr(m, "shard_ms", 0.0))):
            h = self.history.setdefault(flow, deque(maxlen=DEFAULT_HISTORY))
            h.append(multihost_overhead(ms, m.block_ms))  # this flow's share of this block

    def view(self, now: float) -> SessionView:
        bl = list(self.blocks)
        n = max(len(bl), 1)
        block_ms = sum(b.block_ms for b in bl)
        committed = sum(b.accepted + 1 for b in bl)
        drafted = sum(b.k for b in bl)
        spec_blocks = [b for b in bl if b.k > 0]

        def flow(name: str, bytes_attr: str, ms_attr: str, probe: bool) -> FlowView:
            ms = sum(getattr(b, ms_attr) for b in bl)
            return FlowView(flow=name, bytes_per_block=sum(getattr(b, bytes_attr) for b in bl) / n,
                            ms_per_block=ms / n, share_of_block=multihost_overhead(ms, block_ms),
                            probe=probe, history=tuple(self.history.get(name, ())))

        flows = [flow("F1", "f1_bytes", "f1_ms", False), flow("F2", "f2_bytes", "f2_ms", False)]
        if any(b.f3_bytes for b in bl):
            flows.append(flow("F3", "f3_bytes", "f3_ms", any(b.probe for b in bl)))
        elif bl:
            flows.append(f3_estimate(bl, block_ms))
        if any(getattr(b, "shard_bytes", 0) for b in bl):  # a sharded verifier's ranks
            sh = flow("shard", "shard_bytes", "shard_ms", False)
            # priced from the ring's measured latency (the collectives run inside the graph)
            flows.append(replace(sh, estimate=any(getattr(b, "shard_priced", False)
                                                  for b in bl)))
        if self.kv is not None:  # flow KV: the prompt's KV, shipped once (not per block)
            flows.append(FlowView(flow="KV", bytes_per_block=float(self.kv[0]),
                                  ms_per_block=self.kv[1], share_of_block=0.0, history=()))
        loads = [b.rank_load for b in bl if getattr(b, "rank_load", ())]
        hist = list(self.hist)
        while len(hist) > 1 and hist[-1] == 0:
            hist.pop()
        wire = sum(wire_ms(b) for b in bl)
        remote = any(b.f1_bytes for b in bl)
        ahead = [b for b in bl if getattr(b, "ahead_waste", -1.0) >= 0]
        return SessionView(
            session_id=self.session_id, verifier=self.verifier, proposers=self.proposers,
            topology="1 proposer : 1 verifier (2 hosts)" if remote else "local",
            tokens_per_s=committed / (block_ms / 1e3) if block_ms else 0.0,
            acceptance=sum(b.accepted for b in spec_blocks) / drafted if drafted else 0.0,
            mean_accepted=(sum(b.accepted for b in spec_blocks) / len(spec_blocks)
                           if spec_blocks else 0.0),
            draft_len=bl[-1].k if bl else 0, blocks=self.total_blocks,
            accepted_hist=tuple(hist),
            flows=tuple(flows),
            timeline=tuple(BlockSample(block=b.block, k=b.k, accepted=b.accepted,
                                       block_ms=b.block_ms, draft_ms=b.draft_ms,
                                       verify_ms=b.verify_ms,
                                       wire_ms=wire_ms(b)) for b in bl),
            overhead_share=multihost_overhead(wire, block_ms),
            active=now - self.last_seen < ACTIVE_S,
            rank_load=tuple(map(sum, zip(*loads))) if loads else (),
            ahead=(sum(b.ahead_lead for b in ahead) / len(ahead), ahead[-1].ahead_waste)
            if ahead else None,
            drafter=getattr(bl[-1], "drafter", "") if bl else "",
            why=getattr(bl[-1], "why", "") if bl else "",
            drafters=tuple(DrafterShare(name, *t) for name, t in
                           sorted(self.drafters.items(), key=lambda kv: (-kv[1][0], kv[0]))),
        )


def wire_ms(m) -> float:
    """A BlockMetrics' critical-path wire time: F1 + F2 + F3 (stats.BlockFlows.wire_ms)."""
    return m.f1_ms + m.f2_ms + m.f3_ms


F3_BYTES_PER_VALUE = 2  # float16 hidden states


def f3_estimate(bl, block_ms: float) -> FlowView:
    """What F3 would cost these blocks had a hidden-state drafter run on the proposer: the
    committed tokens' hidden rows (float16), priced at the F1+F2 round trip's wire time split
    by bytes (how real F3 is accounted when it rides with F1). Zero on one host."""
    n = len(bl)
    hidden = max((getattr(b, "hidden_size", 0) for b in bl), default=0)
    nbytes = sum((b.accepted + 1) * hidden * F3_BYTES_PER_VALUE for b in bl) / n
    f12_bytes = sum(b.f1_bytes + b.f2_bytes for b in bl) / n
    f12_ms = sum(b.f1_ms + b.f2_ms for b in bl) / n
    ms = f12_ms * nbytes / (f12_bytes + nbytes) if f12_bytes and nbytes else 0.0
    return FlowView(flow="F3", bytes_per_block=nbytes if f12_bytes else 0.0, ms_per_block=ms,
                    share_of_block=multihost_overhead(ms * n, block_ms), probe=False,
                    history=(), estimate=True)
