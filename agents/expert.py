"""Expert parallelism for a mixture-of-experts verifier (`--shard-mode expert`).

Placement: rank r of N holds a contiguous range of every MoE layer's experts (the same split
as pipeline's layer ranges: `layer_range(E, N, r)`; 8 experts over 2 ranks -> 0-3 | 4-7). The
attention, the embeddings, the norms, the LM head and each layer's router are replicated:
every rank runs them on the same input, so every rank picks the same experts for every token.

In a MoE block, each rank finds (on the host: one sync per MoE layer) the (token, slot) pairs
routed to its own experts, runs only those rows through its experts (non-local experts are
never computed), scales them by their router weights and scatters them into a [tokens, hidden]
partial sum; ONE `all_sum` per MoE layer adds the ranks' partials, so every rank continues with
the full output. Collective payload per forward: MoE layers x tokens x hidden x itemsize.

What fits: each rank keeps the replicated part plus E/N of the experts; an MoE's experts are
most of its weights, so this is close to 1/N.

The router's choices are counted here (`RouterLoad`) on the way: per expert, summed over the
MoE layers, and so per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_SWITCH = ("gate_proj", "up_proj", "down_proj")


def expert_range(experts: int, n: int, r: int) -> tuple[int, int]:
    """Rank r's experts [start, end) of `experts` over n ranks (contiguous, sizes differ <= 1)."""
    q, rem = divmod(experts, n)
    start = r * q + min(r, rem)
    return start, start + q + (1 if r < rem else 0)


class RouterLoad:
    """Counts the router's choices: (token, slot) pairs per expert over all MoE layers, plus
    the collective's bytes and time. Mutable; one per stage, shared by its MoE blocks."""

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.per_expert = np.zeros(self.experts, dtype=np.int64)
        self.collective_bytes = 0
        self.collective_ms = 0.0

    def add(self, inds: np.ndarray) -> None:
        self.per_expert += np.bincount(inds.reshape(-1), minlength=self.experts)


class ExpertParallelMoE(nn.Module):
    """A qwen3_moe-style sparse block (router `gate`, `switch_mlp`, top-k, normalised scores)
    holding only experts [start, end); its output is already summed over the group."""

    def __init__(self, block: nn.Module, group: mx.distributed.Group,
                 span: tuple[int, int], load: RouterLoad | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 reduce: Callable[[mx.array], mx.array] | None = None) -> None:
        super().__init__()
        self.gate = block.gate  # the router, replicated
        self.top_k = block.top_k
        self.norm_topk_prob = getattr(block, "norm_topk_prob", True)
        self.switch_mlp = block.switch_mlp
        a, b = span
        for name in _SWITCH:  # keep only this rank's experts: this is the fit
            lin = getattr(self.switch_mlp, name)
            experts = lin.weight.shape[0]
            # every per-expert array: weight, bias, and a quantized layer's scales/biases
            for key, val in list(lin.items()):
                if isinstance(val, mx.array) and val.ndim and val.shape[0] == experts:
                    setattr(lin, key, mx.array(val[a:b]))
        mx.eval(self.switch_mlp.parameters())  # the other experts' weights can go now
        self._span, self._load, self._clock = span, load, clock
        # the collective; tests pass their own to run several ranks' blocks in one process
        self._reduce = reduce or (lambda p: mx.distributed.all_sum(p, group=group))

    def __call__(self, x: mx.array) -> mx.array:
        # x: [B, L, D]
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]  # [B, L, k]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores /= mx.sum(scores, axis=-1, keepdims=True)
        host = np.array(inds)  # the one host sync per MoE layer: which rows are ours
        if self._load is not None:
            self._load.add(host)
        B, L, D = x.shape
        a, b = self._span
        flat = host.reshape(-1, k)
        tok, slot = np.nonzero((flat >= a) & (flat < b))
        part = mx.zeros((B * L, D), dtype=x.dtype)
        if len(tok):
            t = mx.array(tok.astype(np.uint32))
            s = mx.array(slot.astype(np.uint32))
            rows = x.reshape(B * L, D)[t]  # [M, D]
            local = mx.array((flat[tok, slot] - a).astype(np.uint32))[:, None]  # [M, 1]
            out = self.switch_mlp(rows, local)[:, 0, :]  # [M, D]
            w = scores.reshape(B * L, k)[t, s]  # [M]
            part = part.at[t].add((out * w[:, None]).astype(x.dtype))
        mx.eval(part)
        t0 = self._clock()
        y = self._reduce(part)
        mx.eval(y)
        if self._load is not None:
            self._load.collective_ms += (self._clock() - t0) * 1e3
            self._load.collective_bytes += part.nbytes
        return y.reshape(B, L, D)


def is_moe_block(m: nn.Module) -> bool:
    return hasattr(m, "gate") and hasattr(m, "switch_mlp") and hasattr(m, "top_k")


def shard_experts(model: nn.Module, group: mx.distributed.Group) -> tuple[tuple[int, int],
                                                                          RouterLoad]:
    """Replace every MoE block of `model` by this rank's expert-parallel block, in place.

    Returns this rank's expert range and the load counter its blocks feed. ValueError when the
    model has no MoE layer or fewer experts than ranks.
    """
    layers = list(model.model.layers)
    moe = [ly for ly in layers if is_moe_block(getattr(ly, "mlp", None))]
    experts = int(getattr(model.args, "num_experts", 0) or 0)
    n, r = group.size(), group.rank()
    if not moe or experts <= 0:
        raise ValueError("expert parallelism needs a mixture-of-experts model (e.g. tiny-moe:1); "
                         "use tensor or pipeline")
    if experts < n:
        raise ValueError(f"{experts} experts cannot be spread over {n} ranks")
    span = expert_range(experts, n, r)
    load = RouterLoad(experts)
    for ly in moe:
        ly.mlp = ExpertParallelMoE(ly.mlp, group, span, load)
    return span, load
