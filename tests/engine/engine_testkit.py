"""Helpers shared by the engine tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.events import Finished

# The chi-square tests reject at p < 0.001.
ALPHA = 0.001


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


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2),
    by its power series below a + 1 and its continued fraction (modified Lentz) above, both
    to double precision (Numerical Recipes 6.2). No scipy: the test extras stay small."""
    a, y = df / 2.0, x / 2.0
    if y <= 0:
        return 1.0
    log_front = a * math.log(y) - y - math.lgamma(a)
    if y < a + 1.0:  # P(a, y) = e^-y y^a / Gamma(a+1) * sum y^n / ((a+1)...(a+n))
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-17:
            n += 1
            term *= y / (a + n)
            total += term
        return 1.0 - total * math.exp(log_front)
    tiny = 1e-300
    b = y + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """The upper alpha quantile of chi-square(df): x with chi2_sf(x, df) == alpha, by bisection
    on the exact tail (monotone in x) to a relative 1e-12. Checked against published tables in
    test_sampling_lossless.py::test_chi_square_helper."""
    if df < 1 or not 0.0 < alpha < 1.0:
        raise ValueError(f"chi2_critical needs df >= 1 and 0 < alpha < 1, got {df}, {alpha}")
    lo, hi = 0.0, max(1.0, 2.0 * df)
    while chi2_sf(hi, df) > alpha:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def pooled_cells(n: float, probs: np.ndarray, min_expected: float = 5.0) -> list[np.ndarray]:
    """chi2_test's cells for n draws: the indices of `probs` (flattened) whose expected counts
    are below `min_expected` pooled, smallest first, until the pool reaches it (one cell); each
    other index a cell of its own."""
    probs = np.asarray(probs, dtype=np.float64).ravel()
    order = np.argsort(n * probs, kind="stable")
    exp_sorted = (n * probs)[order]
    j, pool = 0, 0.0
    while j < len(order) and (pool < min_expected or exp_sorted[j] < min_expected):
        pool += exp_sorted[j]
        j += 1
    return ([order[:j]] if j else []) + [order[i : i + 1] for i in range(j, len(order))]


def chi2_test(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0
              ) -> tuple[float, int, float]:
    """Pearson chi-square of observed counts against cell probabilities.

    A sample in a zero-probability cell fails outright (the statistic is infinite). Cells whose
    expected count is below `min_expected` are pooled (`pooled_cells`). Returns (statistic,
    degrees of freedom, critical value at p = 0.001).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    assert abs(probs.sum() - 1.0) < 1e-6, probs.sum()
    n = counts.sum()
    cells = pooled_cells(n, probs, min_expected)
    exp = np.array([n * probs[c].sum() for c in cells])
    obs = np.array([counts[c].sum() for c in cells])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 2, "too few cells for a meaningful test"
    if counts[probs == 0].sum() > 0:
        stat = float("inf")
    return stat, df, chi2_critical(df)


def chi2_power(probs: np.ndarray, alt: np.ndarray, n: int, sims: int = 20_000,
               seed: int = 0) -> float:
    """The chance that chi2_test of n draws from `alt` against `probs` rejects: its power
    against that alternative, computed by simulating `sims` multinomial samples of the same
    cells and critical value (no scipy for the noncentral chi-square; the simulation's
    standard error is below 0.0004 for a power above 0.997)."""
    probs = np.asarray(probs, dtype=np.float64).ravel()
    alt = np.asarray(alt, dtype=np.float64).ravel()
    cells = pooled_cells(n, probs)
    exp = np.array([n * probs[c].sum() for c in cells])
    keep = exp > 0
    crit = chi2_critical(int(keep.sum()) - 1)
    counts = np.random.default_rng(seed).multinomial(n, alt / alt.sum(), size=sims)
    obs = np.stack([counts[:, c].sum(axis=1) for c in cells], axis=1)
    stat = ((obs[:, keep] - exp[keep]) ** 2 / exp[keep]).sum(axis=1)
    rejected = (stat >= crit) | (counts[:, probs == 0].sum(axis=1) > 0)
    return float(rejected.mean())


class Draws:
    """A generator whose uniform draws are given (`random()` pops them in order): an acceptance
    rule's outcome at its boundaries, exactly."""

    def __init__(self, *u: float) -> None:
        self.u = list(u)

    def random(self) -> float:
        return self.u.pop(0)


def drafting_contexts(vocab: int) -> list[list[int]]:
    """Four committed contexts of different lengths (5 to 40 tokens) for drafters' tests."""
    rng = np.random.default_rng(4)
    return [rng.integers(0, vocab, size=n).tolist() for n in (5, 23, 11, 40)]


def engine_drafts_together_as_alone(lm, proposer: str) -> dict[int, Finished]:
    """Five requests of different lengths through one serving engine drafting with
    `proposer` (chains drafted together: `draft_together`): each answers what the verifier
    alone does, drafts, and at least one `draft_together` call held several sessions; every
    session's row is given back. Returns each request's Finished by index."""
    import macfleet.serve.engine as serve_engine
    from macfleet.engine.sampling import GREEDY
    from macfleet.engine.verifier import Verifier
    from macfleet.serve.engine import BatchEngine, EngineRequest
    from reference_loops import speculative_generate

    rng = np.random.default_rng(2)
    prompts = [tuple(rng.integers(0, lm.vocab_size, size=n).tolist()) for n in (6, 30, 14, 50, 9)]
    eng = BatchEngine(lm, proposer=proposer, draft_tokens=3, max_active=8)
    done: dict[int, Finished] = {}
    calls: list[int] = []
    real = serve_engine.draft_together

    def counting(jobs, *a, **kw):
        calls.append(len(jobs))
        return real(jobs, *a, **kw)

    serve_engine.draft_together = counting
    try:
        for i, p in enumerate(prompts):
            eng.submit(EngineRequest(p, GREEDY, 12 + 3 * i),
                       lambda ev, i=i: done.__setitem__(i, ev) if isinstance(ev, Finished)
                       else None)
        eng.run_until_idle()
    finally:
        serve_engine.draft_together = real
    for i, p in enumerate(prompts):
        alone = list(speculative_generate(Verifier(lm.model), None, p, params=GREEDY,
                                          max_tokens=12 + 3 * i, eos_ids=lm.eos_ids))[-1]
        assert done[i].token_ids == alone.token_ids
        assert done[i].stats.drafted > 0
    assert max(calls) > 1  # several sessions' chains in one call
    assert all(st.open_rows == 0 for st in eng.session_kv.draft_rows.values())  # given back
    return done
