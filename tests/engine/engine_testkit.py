"""Helpers shared by the engine tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.events import Finished

# Chi-square critical values need the normal quantile at 1 - alpha (alpha = 0.001).
Z_999 = 3.090232306167813


def mlx_lm_greedy(model, prompt: Sequence[int], max_tokens: int,
                  eos_ids: frozenset[int] = frozenset()) -> list[int]:
    """The verifier decoding alone, by mlx-lm's own `generate_step` (greedy), cut at EOS.

    Independent of macfleet's Verifier and loop, so a bug they share cannot hide.
    """
    from mlx_lm.generate import generate_step

    out: list[int] = []
    if max_tokens <= 0:
        return out
    for tok, _ in generate_step(mx.array(list(prompt), dtype=mx.uint32), model,
                                max_tokens=max_tokens):
        t = int(tok)
        if t in eos_ids:
            break
        out.append(t)
    return out


def finished(events) -> Finished:
    evs = list(events)
    assert isinstance(evs[-1], Finished), evs[-1]
    return evs[-1]


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Upper chi-square quantile by the Wilson-Hilferty approximation (good for df >= 2)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def chi2_test(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0
              ) -> tuple[float, int, float]:
    """Pearson chi-square of observed counts against cell probabilities.

    A sample in a zero-probability cell fails outright (the statistic is infinite). Cells whose
    expected count is below `min_expected` are pooled, smallest first, until the pool reaches it
    (the pool is then one cell). Returns (statistic, degrees of freedom, critical value at
    p = 0.001).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    assert abs(probs.sum() - 1.0) < 1e-6, probs.sum()
    n = counts.sum()
    order = np.argsort(n * probs, kind="stable")
    exp_sorted, obs_sorted = (n * probs)[order], counts[order]
    j, pool = 0, 0.0
    while j < len(order) and (pool < min_expected or exp_sorted[j] < min_expected):
        pool += exp_sorted[j]
        j += 1
    exp = np.concatenate([[exp_sorted[:j].sum()], exp_sorted[j:]]) if j else exp_sorted
    obs = np.concatenate([[obs_sorted[:j].sum()], obs_sorted[j:]]) if j else obs_sorted
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 2, "too few cells for a meaningful test"
    if counts[probs == 0].sum() > 0:
        stat = float("inf")
    return stat, df, chi2_critical(df)
