"""Expert parallelism for a mixture-of-experts verifier (`--shard-mode expert`).

Rank r of N holds a contiguous range of every MoE layer's experts (`topology.moe.expert_range`);
attention, embeddings, norms, head and routers are replicated, so every rank routes alike, and
one `all_sum` per MoE layer adds the ranks' partial outputs. A few tokens route on the device,
many on the host (docs/agents.md, "expert.py"); `RouterLoad` counts the router's choices.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macfleet.topology.moe import ROUTE_ON_HOST_MIN_TOKENS, expert_range

_SWITCH = ("gate_proj", "up_proj", "down_proj")


class RouterLoad:
    """Counts the router's choices: (token, slot) pairs per expert over all MoE layers, plus
    the collective's bytes and time. Mutable; one per stage, shared by its MoE blocks."""

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.per_expert = np.zeros(self.experts, dtype=np.int64)
        self.collective_bytes = 0
        self.collective_ms = 0.0  # host-routed forwards only (the device path never waits)
        self._pending: list[mx.array] = []

    def add(self, inds: np.ndarray) -> None:
        self.per_expert += np.bincount(inds.reshape(-1), minlength=self.experts)

    def defer(self, inds: mx.array) -> None:
        """A device-routed block's choices, counted by `flush` once its forward is evaluated."""
        self._pending.append(inds)

    def flush(self) -> None:
        """Count the deferred choices (call after the forward's evaluation: no extra work)."""
        pending, self._pending = self._pending, []
        for inds in pending:
            self.add(np.array(inds))


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
        B, L, D = x.shape
        if B * L < ROUTE_ON_HOST_MIN_TOKENS:
            part = self._on_device(x, inds, scores)
            if self._load is not None:
                self._load.defer(inds)
                self._load.collective_bytes += part.nbytes
            return self._reduce(part)
        return self._on_host(x, inds, scores).reshape(B, L, D)

    def _on_device(self, x: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
        """Every slot through a local expert, the other ranks' slots weighted by 0: no sync."""
        a, b = self._span
        mine = (inds >= a) & (inds < b)
        local = mx.where(mine, inds - a, 0).astype(mx.uint32)
        y = self.switch_mlp(x, local)  # [B, L, k, D]
        # select, not multiply by 0: another rank's slot is exactly 0 even where the local
        # expert it ran through overflowed (float16) for a token never routed to it
        y = mx.where(mine[..., None], y * scores[..., None], mx.zeros_like(y))
        return y.sum(axis=-2).astype(x.dtype)

    def _on_host(self, x: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
        """Only the rows routed here are computed (one host read of the router's choice)."""
        k = self.top_k
        host = np.array(inds)
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
        return y


def shard_experts(model: nn.Module, group: mx.distributed.Group) -> RouterLoad:
    """Replace every MoE block of `model` by this rank's expert-parallel block, in place;
    returns the load counter its blocks feed. ValueError when the model has no MoE layer or
    fewer experts than ranks."""
    moe = [ly for ly in model.model.layers if all(hasattr(getattr(ly, "mlp", None), a)
                                                  for a in ("gate", "switch_mlp", "top_k"))]
    experts = int(getattr(model.args, "num_experts", 0) or 0)
    n, r = group.size(), group.rank()
    if not moe or experts <= 0:
        raise ValueError("expert parallelism needs a mixture-of-experts model (e.g. tiny-moe:1); "
                         "use tensor or pipeline")
    if experts < n:
        raise ValueError(f"{experts} experts cannot be spread over {n} ranks")
    load = RouterLoad(experts)
    for ly in moe:
        ly.mlp = ExpertParallelMoE(ly.mlp, group, expert_range(experts, n, r), load)
    return load
