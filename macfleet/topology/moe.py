"""Which way to shard a mixture-of-experts verifier: expert, tensor or pipeline parallelism.

Pure. `choose_moe_mode(model, mem_free, link, verify_ms)` prices each mode for one forward of
`tokens` positions over n ranks and picks the fastest that fits, with the reason in words.

Per mode (n ranks; t = verify(tokens) of the whole model on one host, f of it its dispatch floor
(`cost.dispatch_floor_ms`: the ops' own overhead, which no mode divides; 0 when not known) and
w = t - f its weight reads; S = tokens x hidden x 4 bytes, one [tokens, hidden] float32
activation):
* tensor (mlx-lm `shard()`): every rank holds 1/n of every matrix; compute f + w/n; two ring
  all-reduces of S per layer. Needs heads, kv heads and the experts' width divisible by n.
* pipeline: rank r holds layers/n; compute t (the stages run in turn); S over each of the n-1
  boundaries and the logits [tokens, vocab] back to rank 0. Fits like tensor.
* expert (agents/expert.py): whole experts per rank, the rest (attention, embeddings, routers)
  replicated; compute: f, the replicated reads in full, the experts' reads / n; one ring all-reduce
  of S per MoE layer; a forward of `ROUTE_ON_HOST_MIN_TOKENS` positions or more also pays a
  host sync per MoE layer (the rank reads the router's choice), fewer route on the device.
  Memory: replicated part + experts / n.
Every mode also pays the leader's command broadcast (one small all-reduce) per forward.
Compute is split by bytes read (decode is bandwidth-bound): the experts' share of a forward is
what the tokens' routed experts weigh against the replicated weights.
A ring all-reduce of S over n ranks is 2(n-1) steps of S/n, each paying half a round trip;
or, when the ring was measured (`RingLatency`: `macfleet bench moe` pings it), its small-payload
all-reduce and hop latencies plus the bytes at the link's rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from macfleet.topology.fleet_spec import DEFAULT_MEM_OVERHEAD, Link, ModelShape

ACT_BYTES = 4  # float32 activations on the wire
EXPERT = "expert"
TENSOR = "tensor"
PIPELINE = "pipeline"
MOE_MODES = (EXPERT, TENSOR, PIPELINE)
DEFAULT_SYNC_MS = 0.05  # expert mode: one host read of the router's choice per MoE layer
# expert mode routes a forward of this many positions or more on the host (one sync per MoE
# layer, only the local rows computed: prefill is compute-bound), fewer on the device (no sync,
# every slot through a local expert: decode is bandwidth-bound). agents/expert.py reads it.
ROUTE_ON_HOST_MIN_TOKENS = 32
# every forward of a shard group starts with the leader's command broadcast (agents/shard.py:
# an all_sum of HEADER + MAX_BLOCK int32), whatever the mode
CONTROL_BYTES = (3 + 512) * 4


@dataclass(frozen=True)
class RingLatency:
    """A shard ring's measured latencies of a small all_sum and of one send/recv hop (ms)."""

    allreduce_ms: float
    hop_ms: float


@dataclass(frozen=True, kw_only=True)
class ModeEstimate:
    mode: str
    possible: bool  # the model's shape allows it over n ranks
    fits: bool  # and every rank's share fits its host's free memory
    mem_per_rank: int  # bytes, the largest share (with the runtime overhead)
    bytes_per_forward: int  # collective payload of one forward (exact for the shapes given)
    compute_ms: float
    comm_ms: float
    why_not: str = ""

    @property
    def forward_ms(self) -> float:
        return self.compute_ms + self.comm_ms


@dataclass(frozen=True)
class MoeChoice:
    mode: str  # the chosen mode; "" when none fits
    estimates: tuple[ModeEstimate, ...]  # best first (usable ones by forward time)
    reason: str


def expert_range(experts: int, n: int, r: int) -> tuple[int, int]:
    """Rank r's experts [start, end) over n ranks: contiguous, sizes differ by at most one
    (the placement agents/expert.py uses)."""
    q, rem = divmod(experts, n)
    start = r * q + min(r, rem)
    return start, start + q + (1 if r < rem else 0)


def _size(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def moe_layers(model: ModelShape) -> int:
    return (model.moe_layers or model.layers) if model.experts else 0


def routed_fraction(model: ModelShape, tokens: int) -> float:
    """Expected share of a layer's experts that `tokens` positions touch (uniform routing)."""
    if not model.experts:
        return 0.0
    k = min(model.experts_per_tok or 1, model.experts)
    return 1.0 - (1.0 - k / model.experts) ** max(1, tokens)


def bytes_read(model: ModelShape, tokens: int) -> float:
    """Weight bytes one forward of `tokens` positions reads: every dense weight, and the
    experts its tokens are routed to."""
    dense = model.param_bytes - model.expert_bytes
    return dense + routed_fraction(model, tokens) * model.expert_bytes


def expert_time_share(model: ModelShape, tokens: int) -> float:
    """The experts' share of a forward's weight reads."""
    total = bytes_read(model, tokens)
    return routed_fraction(model, tokens) * model.expert_bytes / total if total > 0 else 0.0


def ring_rounds(mode: str, n: int, layers: int, moe_layers: int, want_logits: bool = True
                ) -> float:
    """One forward's collectives on its critical path over n ranks, in small ring all-reduces:
    tensor two per layer, expert one per MoE layer; a pipeline's hops (one per boundary, plus
    the logits back) each one of an all-reduce's 2(n - 1) ring steps. What `estimate` prices
    per collective, and what a shard group's leader prices its untimed collectives by
    (agents/shard_traffic.py)."""
    if n <= 1:
        return 0.0
    if mode == TENSOR:
        return 2.0 * layers
    if mode == EXPERT:
        return float(moe_layers)
    return ((n - 1) + (1 if want_logits else 0)) / (2 * (n - 1))


def allreduce_ms(link: Link, nbytes: float, n: int, ring: RingLatency | None = None) -> float:
    if n <= 1:
        return 0.0
    if ring is not None:
        return ring.allreduce_ms + 2 * (n - 1) * (nbytes / n) / (link.bandwidth_mb_s * 1e3)
    return 2 * (n - 1) * link.transfer_ms(nbytes / n)


def hop_ms(link: Link, nbytes: float, ring: RingLatency | None = None) -> float:
    if ring is not None:
        return ring.hop_ms + nbytes / (link.bandwidth_mb_s * 1e3)
    return link.transfer_ms(nbytes)


def collective_bytes(model: ModelShape, mode: str, n: int, tokens: int,
                     want_logits: bool = True) -> int:
    """Payload of one forward's collectives (what agents/shard_traffic.py counts)."""
    if n <= 1:
        return 0
    s = tokens * model.hidden * ACT_BYTES
    if mode == TENSOR:
        return 2 * model.layers * s
    if mode == EXPERT:
        return moe_layers(model) * s
    return (n - 1) * s + (tokens * model.vocab * ACT_BYTES if want_logits else 0)


def _why_impossible(model: ModelShape, mode: str, n: int) -> str:
    if mode == EXPERT:
        if not model.experts:
            return "not a mixture of experts"
        if model.experts < n:
            return f"{model.experts} experts < {n} ranks"
    elif mode == TENSOR:
        widths = {"heads": model.heads, "kv heads": model.kv_heads,
                  "expert width": model.expert_intermediate}
        bad = [f"{k} {v}" for k, v in widths.items() if v and v % n]
        if bad:
            return f"{', '.join(bad)} not divisible by {n}"
    elif model.layers < n:
        return f"{model.layers} layers < {n} ranks"
    return ""


def mem_per_rank(model: ModelShape, mode: str, n: int) -> int:
    if mode == EXPERT:
        dense = model.param_bytes - model.expert_bytes
        share = dense + -(-model.expert_bytes // n)
    elif mode == PIPELINE:
        share = model.param_bytes * -(-model.layers // n) / model.layers
    else:
        share = model.param_bytes / n
    return int(share * DEFAULT_MEM_OVERHEAD)


def estimate(model: ModelShape, mode: str, n: int, mem_free: Sequence[int], link: Link,
             verify_ms: float, tokens: int = 1, sync_ms: float = DEFAULT_SYNC_MS,
             ring: RingLatency | None = None, floor_ms: float = 0.0) -> ModeEstimate:
    """One mode over n ranks (mem_free: each rank host's free bytes, largest first;
    floor_ms: the part of verify_ms no mode divides)."""
    why = _why_impossible(model, mode, n)
    mem = mem_per_rank(model, mode, n)
    fits = not why and len(mem_free) >= n and all(m >= mem for m in list(mem_free)[:n])
    if not why and not fits:
        why = f"{_size(mem)} per rank does not fit"
    s = tokens * model.hidden * ACT_BYTES
    floor = min(floor_ms, verify_ms)
    reads = verify_ms - floor
    if mode == TENSOR:
        compute = floor + reads / n
        comm = ring_rounds(mode, n, model.layers, 0) * allreduce_ms(link, s, n, ring)
    elif mode == EXPERT:
        share = expert_time_share(model, tokens)
        syncs = moe_layers(model) if tokens >= ROUTE_ON_HOST_MIN_TOKENS else 0
        compute = floor + reads * (1 - share + share / n) + syncs * sync_ms
        comm = ring_rounds(mode, n, model.layers, moe_layers(model)) * allreduce_ms(link, s, n,
                                                                                  ring)
    else:
        compute = verify_ms
        comm = (n - 1) * hop_ms(link, s, ring) + hop_ms(link, tokens * model.vocab * ACT_BYTES,
                                                          ring)
    comm += allreduce_ms(link, CONTROL_BYTES, n, ring)
    return ModeEstimate(mode=mode, possible=not _why_impossible(model, mode, n), fits=fits,
                        mem_per_rank=mem,
                        bytes_per_forward=collective_bytes(model, mode, n, tokens),
                        compute_ms=compute, comm_ms=comm, why_not=why)


def choose_moe_mode(model: ModelShape, n: int, mem_free: Sequence[int], link: Link,
                    verify_ms: float, tokens: int = 1, sync_ms: float = DEFAULT_SYNC_MS,
                    ring: RingLatency | None = None, floor_ms: float = 0.0) -> MoeChoice:
    """The fastest mode that fits over n ranks, every mode's estimate, and why in words."""
    mem = sorted(mem_free, reverse=True)
    est = [estimate(model, m, n, mem, link, verify_ms, tokens, sync_ms, ring, floor_ms)
           for m in MOE_MODES]
    ranked = sorted(est, key=lambda e: (not e.fits, e.forward_ms, e.bytes_per_forward))
    best = ranked[0]
    if not best.fits:
        return MoeChoice("", tuple(ranked), "no mode fits over "
                         f"{n} ranks: " + "; ".join(f"{e.mode}: {e.why_not}" for e in ranked))
    others = ", ".join(f"{e.mode}: {e.why_not}" if e.why_not else f"{e.mode} {e.forward_ms:.1f} ms"
                       for e in ranked[1:])
    return MoeChoice(best.mode, tuple(ranked), (
        f"{best.mode} over {n}: {best.forward_ms:.1f} ms per forward of {tokens} "
        f"(compute {best.compute_ms:.1f} + collectives {best.comm_ms:.1f}, "
        f"{best.bytes_per_forward:,} B, {_size(best.mem_per_rank)} per rank); "
        f"{others}"))
