"""The CPU's exp, SiLU, softmax and attention (engine/fastmath.py) against MLX's own ops.

Tolerances: relative ~1e-6 -- the polynomial's error (~2e-7) plus float32 rounding of the
other arithmetic; MLX's own ops are the reference on any CPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macfleet.engine import fastmath


def test_exp_matches_mlx_over_the_float_range():
    x = mx.concatenate([mx.linspace(-87.0, 88.0, 20001), mx.array([0.0, -1e-8, 1e-8, -200.0])])
    got, want = np.array(fastmath.exp(x)), np.array(mx.exp(x))
    ok = want > 1e-37  # normal results
    assert np.allclose(got[ok], want[ok], rtol=1e-6, atol=0)
    assert np.all(np.abs(got[~ok]) < 1e-37)


def test_swiglu_and_softmax_match_mlx():
    rng = np.random.default_rng(0)
    g = mx.array(rng.normal(0, 4, (3, 7, 1536)).astype(np.float32))
    x = mx.array(rng.normal(0, 1, (3, 7, 1536)).astype(np.float32))
    want = np.array(nn.silu(g) * x)
    assert np.allclose(np.array(fastmath.swiglu(g, x)), want, rtol=1e-5, atol=1e-6)
    s = mx.array(rng.normal(0, 6, (2, 9, 5, 300)).astype(np.float32))
    assert np.allclose(np.array(fastmath.softmax(s)), np.array(mx.softmax(s, axis=-1)),
                       rtol=1e-5, atol=1e-8)


def _qkv(seed: int, b: int, length: int, t: int) -> list[mx.array]:
    """q [b, 9, length, 64] and k, v [b, 3, t, 64]: SmolLM2's grouped heads."""
    rng = np.random.default_rng(seed)
    return [mx.array(rng.normal(size=(b, h, n, 64)).astype(np.float32))
            for h, n in ((9, length), (3, t), (3, t))]


def test_attention_matches_sdpa_with_grouped_heads_and_a_mask():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(1, 4, 3, 40)
    mask = rng.random((4, 1, 3, 40)) < 0.7
    mask[..., 0] = True  # every query keeps a key
    m = mx.array(mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
    got = fastmath.attention(q, k, v, 0.125, m)
    assert np.allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
    assert np.allclose(np.array(fastmath.attention(q, k, v, 0.125, None)),
                       np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)),
                       rtol=1e-4, atol=1e-5)


def test_causal_sdpa_matches_mlx_and_reuses_its_mask():
    q, k, v = _qkv(2, 1, 5, 12)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert np.allclose(np.array(fastmath.sdpa(q, k, v, 0.125, "causal")), np.array(want),
                       rtol=1e-4, atol=1e-5)
    assert fastmath.causal_mask(5, 12) is fastmath.causal_mask(5, 12)


def test_masked_and_vanishing_weights_are_exactly_zero_not_subnormal():
    """A masked score's weight is 0: 2^-126 divided by its row's sum would be a subnormal, on
    which x86 computes many times slower (a causal prompt chunk is half masked)."""
    tiny = np.finfo(np.float32).tiny  # the smallest normal float
    x = mx.array([-87.5, -100.0, -1e30, -87.0], dtype=mx.float32)
    got = np.array(fastmath.exp(x))
    assert np.all(got[:3] == 0.0) and got[3] >= tiny
    s = mx.array([[0.0, 1.0, fastmath.MASKED, fastmath.MASKED, -120.0]], dtype=mx.float32)
    p = np.array(fastmath.softmax(s))[0]
    assert np.all(p[2:] == 0.0) and np.all(p[:2] > tiny)
