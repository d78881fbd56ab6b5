"""Sampling parameters and logits -> probabilities, shared by verifier and proposers.

The verifier's distribution p and a proposer's q must be produced by the same transform so the
ratio test is lossless with respect to what "the verifier sampling alone" means: softmax of
logits / temperature, then nucleus (top-p) truncation, renormalised.
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
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    scaled = logits.astype(mx.float32) / params.temperature
    p = np.array(mx.softmax(scaled, axis=-1), dtype=np.float64)
    if params.top_p < 1.0:
        p = top_p_filter(p, params.top_p)
    return p


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


def make_rng(params: SamplingParams, stream: int = 0) -> np.random.Generator:
    """A generator per (seed, stream): the verifier and each proposer draw from their own."""
    seed = params.seed
    return np.random.default_rng(None if seed is None else [seed, stream])
