"""The cost model: predicted tokens per second of one placement. Pure arithmetic.

Speculative decoding with per-token acceptance α and k drafts commits
    E(k) = (1 - α^(k+1)) / (1 - α)
tokens per block (the accepted prefix plus the verifier's own next token). A block costs
    verify(k+1) + wire + drafting,
where drafting is k·c on the verifier's host (same GPU, serial) and max(k·c, verify) when the
proposer is on another host and drafts block k+1 while block k is verified (cross-round).
"""

from __future__ import annotations

from dataclasses import dataclass

from macfleet.topology.fleet_spec import Link, ModelShape, Profile

MSG_OVERHEAD_BYTES = 256  # header + msgpack body of one F1/F2 message
ID_BYTES = 4
ALLREDUCES_PER_LAYER = 2  # attention out-projection and MLP down-projection (sharded-to-all)
ACT_BYTES = 4  # float32 activations on the wire
MAX_K = 16

# Rough unified-memory bandwidth (GB/s): decode is bandwidth-bound, so verify time scales by it.
CHIP_BANDWIDTH_GB_S: tuple[tuple[str, float], ...] = (
    ("m1 ultra", 800), ("m2 ultra", 800), ("m3 ultra", 819),
    ("m1 max", 400), ("m2 max", 400), ("m3 max", 400), ("m4 max", 546),
    ("m1 pro", 200), ("m2 pro", 200), ("m3 pro", 150), ("m4 pro", 273),
    ("m1", 68), ("m2", 100), ("m3", 100), ("m4", 120),
)


def chip_bandwidth(chip: str) -> float | None:
    c = chip.lower()
    for name, bw in CHIP_BANDWIDTH_GB_S:
        if name in c:
            return bw
    return None


def dispatch_floor_ms(verify_ms: float, bytes_read: float, bandwidth_gb_s: float | None) -> float:
    """The part of a forward's time that is not reading weights: dispatching its ops (kernel
    launches on Metal, op overhead on a CPU). A shard group does not divide it -- every rank
    of a tensor or expert group runs every layer's ops, a pipeline's stages run theirs in turn
    -- while the weight reads split across ranks. verify_ms less `bytes_read` at the chip's
    bandwidth; 0 when the bandwidth is unknown (then the whole forward is taken to split)."""
    if not bandwidth_gb_s:
        return 0.0
    return max(0.0, verify_ms - bytes_read / (bandwidth_gb_s * 1e6))


def chip_factor(chip: str, ref_chip: str) -> float:
    """Time multiplier for `chip` relative to the chip the profile was measured on (1 if unknown)."""
    a, b = chip_bandwidth(chip), chip_bandwidth(ref_chip)
    return b / a if a and b else 1.0


def expected_tokens(alpha: float, k: int) -> float:
    """E(k): mean tokens committed per block (1 when k = 0: plain decoding)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_tokens_tree(alpha: float, k: int, n: int) -> float:
    """N independent branches of k drafts verified together; the longest accepted one wins.

    P(best branch accepts >= j) = 1 - (1 - α^j)^n, so E = 1 + Σ_j 1 - (1 - α^j)^n.
    Independence is optimistic (branches from similar drafters agree); n = 1 gives E(k).
    """
    return 1.0 + sum(1 - (1 - alpha**j) ** n for j in range(1, k + 1))


@dataclass(frozen=True)
class BlockCost:
    k: int
    tokens_per_block: float
    verify_ms: float
    draft_ms: float  # drafting on the critical path
    wire_ms: float  # bytes moved on the critical path
    shard_ms: float = 0.0  # all-reduce / activation hops inside a sharded verifier

    @property
    def block_ms(self) -> float:
        return self.verify_ms + self.draft_ms + self.wire_ms + self.shard_ms

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens_per_block / self.block_ms

    @property
    def overhead_share(self) -> float:
        """Share of the block spent moving bytes between hosts: the prediction of the measured
        multi-host overhead (`macfleet.stats.multihost_overhead`: F1-F3 over block time) plus a
        sharded verifier's collectives, which measured runs show as a flow of their own."""
        return (self.wire_ms + self.shard_ms) / self.block_ms


def wire_ms(link: Link, k: int, tokens_back: float, vocab: int, with_probs: bool) -> float:
    """F2 (drafts, + probabilities when sampling) then F1 (accepted ids) over the link."""
    if link.rtt_ms == 0 and link.bandwidth_mb_s >= 1e9:
        return 0.0
    f2 = MSG_OVERHEAD_BYTES + k * ID_BYTES + (k * vocab * 4 if with_probs else 0)
    f1 = MSG_OVERHEAD_BYTES + tokens_back * ID_BYTES
    return link.transfer_ms(f2) + link.transfer_ms(f1)


def shard_ms(model: ModelShape, mode: str, n: int, tokens: int, link: Link) -> float:
    """Inter-host time of one sharded forward over `tokens` positions.

    tensor: 2 all-reduces per layer; a ring all-reduce of S bytes over n ranks takes 2(n-1)
      steps of S/n bytes, each paying half a round trip.
    expert (MoE, topology/moe.py): 1 all-reduce per MoE layer.
    pipeline: n-1 activation hops forward and the chosen ids back.
    """
    if n <= 1:
        return 0.0
    act = model.hidden * ACT_BYTES * tokens
    one = 2 * (n - 1) * link.transfer_ms(act / n)
    if mode == "tensor":
        return model.layers * ALLREDUCES_PER_LAYER * one
    if mode == "expert":
        return (model.moe_layers or model.layers) * one
    return (n - 1) * link.transfer_ms(act) + link.transfer_ms(MSG_OVERHEAD_BYTES)


def verify_ms_on(profile: Profile, L: int, chip: str, shard_n: int = 1, mode: str = "",
                 expert_share: float = 0.0) -> float:
    """Compute time of verify(L) on `chip`; tensor-parallel splits the weights read by n,
    expert-parallel only the experts' share (topology/moe.py expert_time_share)."""
    base = profile.verify(L) * chip_factor(chip, profile.ref_chip)
    if mode == "expert":
        return base * (1 - expert_share + expert_share / shard_n)
    return base / shard_n if mode == "tensor" else base


def best_k(cost_of_k) -> BlockCost:
    """The draft length with the highest predicted tokens/s (k = 0 is plain decoding)."""
    return max((cost_of_k(k) for k in range(0, MAX_K + 1)), key=lambda c: c.tokens_per_s)
