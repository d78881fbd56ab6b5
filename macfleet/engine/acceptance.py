"""Acceptance rules: pure functions deciding how much of a draft block the verifier keeps.

Each returns (accepted, next_token): the first `accepted` drafts are committed, then the
verifier's correction or bonus token. Shapes: draft [k]; target rows [k + 1, V] (row i scores the
token after block input i). Greedy exact match, exact-match sampling and the ratio test, each
lossless: docs/engine.md, "Acceptance rules".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from macfleet.engine.sampling import sample


def accept_greedy(draft: Sequence[int], target_ids: Sequence[int]) -> tuple[int, int]:
    """target_ids: [k + 1] argmax of the verifier at each block position."""
    n = 0
    for d, t in zip(draft, target_ids):
        if int(d) != int(t):
            break
        n += 1
    return n, int(target_ids[n])


def accept_exact_sample(draft: Sequence[int], p: np.ndarray,
                        rng: np.random.Generator) -> tuple[int, int]:
    """p: [k + 1, V] verifier probabilities."""
    for i, d in enumerate(draft):
        y = sample(p[i], rng)
        if y != int(d):
            return i, y
    return len(draft), sample(p[len(draft)], rng)


def residual(p_row: np.ndarray, q_row: np.ndarray) -> np.ndarray:
    """Normalised max(p - q, 0); falls back to p when p <= q everywhere (measure-zero case)."""
    r = np.maximum(p_row - q_row, 0.0)
    s = r.sum()
    return r / s if s > 0 else p_row


def accept_ratio(draft: Sequence[int], q: np.ndarray, p: np.ndarray,
                 rng: np.random.Generator) -> tuple[int, int]:
    """q: [k, V] draft probabilities the tokens were sampled from; p: [k + 1, V]."""
    for i, d in enumerate(draft):
        d = int(d)
        qi = q[i, d]
        if qi <= 0.0 or rng.random() >= min(1.0, p[i, d] / qi):
            return i, sample(residual(p[i], q[i]), rng)
    return len(draft), sample(p[len(draft)], rng)
