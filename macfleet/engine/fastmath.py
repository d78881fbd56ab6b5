"""exp, SiLU and softmax for MLX's CPU backend, where its own `exp` is scalar.

Here exp is 2^(x log2 e), split into 2^n (the float's exponent bits) and 2^f, f in [-1/2, 1/2],
by its degree-7 Taylor polynomial (below float32's own rounding), all multiply-adds that one
compiled kernel fuses. Only the CPU uses these (`enabled()`); every path of one verifier uses the
same functions, so "identical to the verifier alone" keeps its meaning. Why: docs/engine.md,
"CPU math".
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

LOG2E = 1.4426950408889634
# 2^f = e^(f ln 2) on [-1/2, 1/2]: (ln 2)^k / k!, highest power first
_EXP2_POLY = tuple(math.log(2) ** k / math.factorial(k) for k in range(7, -1, -1))
_MIN_EXP2 = -126.0  # 2^-126: the smallest normal float; below it the result is 0


def _exp2(x: mx.array) -> mx.array:
    """2^x; exactly 0 below 2^-126, since subnormal weights are many times slower on x86 and
    add nothing to a softmax's sum (docs/engine.md, "CPU math")."""
    under = x < _MIN_EXP2
    x = mx.maximum(x, _MIN_EXP2)
    n = mx.floor(x + 0.5)
    f = x - n
    p = mx.array(_EXP2_POLY[0], dtype=x.dtype)
    for c in _EXP2_POLY[1:]:
        p = p * f + c
    return mx.where(under, 0.0,
                    p * mx.view((n.astype(mx.int32) + 127) << 23, mx.float32).astype(x.dtype))


@mx.compile  # per shape: `view` cannot be shapeless (one cached kernel serves them all)
def exp(x: mx.array) -> mx.array:
    """e^x for float32 x <= 88 (above it, where exp overflows anyway, the result is wrong)."""
    return _exp2(x * LOG2E)


@mx.compile  # per shape: `view` cannot be shapeless (one cached kernel serves them all)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's llama MLP computes it."""
    return gate * x / (1.0 + _exp2(-gate * LOG2E))


@mx.compile  # per shape: `view` cannot be shapeless (one cached kernel serves them all)
def _shifted_exp(s: mx.array, m: mx.array) -> mx.array:
    return _exp2((s - m) * LOG2E)


def softmax(s: mx.array) -> mx.array:
    """Softmax over the last axis (float32 in, float32 out)."""
    e = _shifted_exp(s, s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


MASKED = -1e30  # a masked score: exp gives 0, and a row with no key left stays finite


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
              mask: mx.array | None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` with this module's softmax, one matmul per KV head:
    q [B, H, L, d], k, v [B, Hk, T, d], mask None or bool [L, T] or [B | 1, 1, L, T]."""
    b, h, length, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    g = h // hk
    s = (q * scale).reshape(b, hk, g * length, d) @ k.swapaxes(-1, -2)  # [B, Hk, g*L, T]
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [B | 1, 1, L, T]
        s = mx.where(mask[:, :, None], s.reshape(b, hk, g, length, t), MASKED)
        s = s.reshape(b, hk, g * length, t)
    return (softmax(s.astype(mx.float32)).astype(v.dtype) @ v).reshape(b, h, length, d)


@lru_cache(maxsize=8)
def causal_mask(length: int, t: int) -> mx.array:
    """[1, 1, length, t] bool: query i sees keys up to t - length + i (evaluated, cached)."""
    m = (mx.arange(t)[None] <= mx.arange(t - length, t)[:, None])[None, None]
    mx.eval(m)
    return m


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float,
         mask: mx.array | str | None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` (mask None, "causal" or bool), with this module's
    softmax on the CPU where MLX's runs its scalar exp (several queries, or a mask)."""
    length, t = q.shape[2], k.shape[2]
    if not enabled() or (length == 1 and mask is None):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    if isinstance(mask, str):
        mask = causal_mask(length, t)
    return attention(q, k, v, scale, mask)


class MLP(llama.MLP):
    """mlx-lm's llama MLP with this module's SiLU (same weights, same module tree)."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def install(model: nn.Module, on: bool = True) -> int:
    """On the CPU, give every llama-family MLP of `model` this module's SiLU (its class
    changes, not its weights); returns how many. on=False gives mlx-lm's back."""
    if on and not enabled():
        return 0
    frm, to = (llama.MLP, MLP) if on else (MLP, llama.MLP)
    n = 0
    for _, m in model.named_modules():
        if type(m) is frm:
            m.__class__ = to
            n += 1
    return n


# =1: MLX's own ops everywhere (mlx-lm's arithmetic, bit for bit)
EXACT_ENV = "MACFLEET_EXACT_MATH"


def enabled() -> bool:
    """Whether this process computes on the CPU, unless MACFLEET_EXACT_MATH=1."""
    return mx.default_device() == mx.cpu and os.environ.get(EXACT_ENV) != "1"
