"""Sampling parameters and logits -> probabilities, shared by verifier and proposers: p and q
come from the same transform (softmax of logits / temperature, top-p truncated, renormalised)
so the ratio test is lossless against the verifier sampling alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# Below this, logits / temperature overflows float32 (1e-38 gave the last vocabulary token on
# every step): such temperatures are taken as greedy, which is what they tend to anyway.
MIN_TEMPERATURE = 1e-5


MAX_SEED = 2**63 - 1  # what numpy's generators take (a negative seed is refused)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # documented floor: greedy
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (isinstance(self.seed, int)
                                          and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in 0..{MAX_SEED}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def probs_from_logits(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """logits: [L, V] -> probabilities [L, V] float64 (numpy), after temperature and top-p."""
    return host_probs(softmax_probs(logits, params), params)


def softmax_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """`probs_from_logits`' device half, lazy: the tempered softmax [L, V] float32 (a caller
    evaluates it with other arrays, then hands it to `host_probs`)."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    return mx.softmax(logits.astype(mx.float32) / params.temperature, axis=-1)


def host_probs(p: mx.array, params: SamplingParams) -> np.ndarray:
    """`probs_from_logits`' host half: `softmax_probs`' output -> float64 numpy, after top-p."""
    out = np.array(p, dtype=np.float64)
    return top_p_filter(out, params.top_p) if params.top_p < 1.0 else out


def top_p_filter(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (per row)."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    cum = np.cumsum(sorted_p, axis=-1)
    keep_sorted = (cum - sorted_p) < top_p  # always keeps the top token
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    out = np.where(keep, p, 0.0)
    return out / out.sum(axis=-1, keepdims=True)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a probability row (float64, sums to 1)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


def device_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """`probs_from_logits` on the device: logits [L, V] -> lazy float32 probabilities [L, V];
    plain and speculative decoding both use it, so "the verifier's distribution" is one."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    p = mx.softmax(logits.astype(mx.float32) / params.temperature, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-p, axis=-1)
        sorted_p = mx.take_along_axis(p, order, axis=-1)
        keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < params.top_p
        keep = mx.put_along_axis(mx.zeros(p.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        p = mx.where(keep, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    return p


_M64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def generation_seed(params: SamplingParams) -> int:
    """The seed a sampled generation draws its positions' keys from: the request's, or fresh."""
    if params.seed is not None:
        return params.seed
    return int(np.random.default_rng().integers(MAX_SEED))


def position_keys(seed: int, stream: int, start: int, n: int, purpose: int) -> mx.array:
    """n mx.random keys [n, 2] uint32, one per output position start .. start + n - 1, from
    (seed, stream, t, purpose) only: position t draws alike however blocks grouped it."""
    base = _splitmix(_splitmix(_splitmix(seed & _M64) ^ stream) ^ purpose)
    hs = [_splitmix(base ^ (start + i)) for i in range(n)]
    return mx.array([[h >> 32, h & 0xFFFFFFFF] for h in hs], dtype=mx.uint32).reshape(n, 2)


def make_rng(params: SamplingParams, stream: int = 0) -> np.random.Generator:
    """A generator per (seed, stream): the verifier and each proposer draw from their own."""
    seed = params.seed
    return np.random.default_rng(None if seed is None else [seed, stream])
