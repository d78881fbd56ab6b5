"""Sampling is lossless: every committed token is distributed as the verifier's own.

The acceptance rules are checked as pure functions with many trials (a chi-square test at
p = 0.001 against the verifier's distribution p, with a DIFFERENT draft distribution q), and the
same check is shown to reject deliberately broken rules, so it has the power to fail. Then the
whole loop (`speculative_generate` with a draft model) is checked on the joint distribution of
its first two committed tokens, against the verifier's exact p(t1) * p(t2 | t1).

The draw counts are what the power asks: each broken rule's exact distribution is computed
(`broken_law`, `broken_loop_law`), and test_each_draw_count_has_the_power_to_catch_each_broken_
rule asserts the chance that each check rejects it (`chi2_power`) is at least POWER.

Models: 1-layer tiny models with unscaled weights over an 8-token vocabulary, so p and q are
spread out (entropy ~1.5 nats) and differ (about half of the drafts are rejected), and a forward
costs ~1 ms, which is what makes thousands of full generations affordable.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from engine_testkit import Draws, chi2_power, chi2_test

import reference_rules as acceptance
from reference_rules import accept_exact_sample, accept_ratio
from macfleet.engine.tree import residual
from macfleet.engine.controller import make_controller
from reference_loops import speculative_generate
from macfleet.engine.proposers.base import Draft, Proposer
from macfleet.engine.proposers.model_draft import ModelProposer
from macfleet.engine.sampling import (SamplingParams, make_rng, probs_from_logits, sample,
                                      top_p_filter)
from macfleet.engine.tiny import build_tiny_model
from macfleet.engine.verifier import Verifier

VOCAB = 8
PROMPT = [1]
TRIALS = 3_000  # each host check's draws (the power test says why that is enough)
# the inverted ratio moves little mass when p has a nucleus (zeros where q has mass): catching
# it there takes this many draws; without a nucleus TRIALS catch it
NUCLEUS_INVERTED_TRIALS = 20_000
POWER = 0.999  # the least chance a check must have to reject each broken rule
T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def models():
    """(verifier model, draft model): different seeds, so p != q."""
    return (build_tiny_model(1, VOCAB, layers=1, weight_scale=1.0),
            build_tiny_model(3, VOCAB, layers=1, weight_scale=1.0))


def next_probs(model, ctx, params=T1) -> np.ndarray:
    return probs_from_logits(model(mx.array([ctx], dtype=mx.uint32))[0, -1:], params)[0]


@pytest.fixture(scope="module", params=[1.0, 0.8], ids=["top_p=1", "top_p=0.8"])
def pq(request, models) -> tuple[np.ndarray, np.ndarray]:
    params = SamplingParams(1.0, top_p=request.param)
    p, q = next_probs(models[0], PROMPT, params), next_probs(models[1], PROMPT, params)
    tv = 0.5 * np.abs(p - q).sum()
    assert tv > 0.25, f"p and q are too close (TV {tv:.3f}) for the test to mean anything"
    assert (p > 0.02).sum() >= 3, p
    return p, q


Rule = Callable[[list[int], np.ndarray, np.ndarray, np.random.Generator], tuple[int, int]]


def first_token_counts(rule: Rule, p: np.ndarray, q: np.ndarray, k: int,
                       seed: int = 1234, trials: int = TRIALS) -> np.ndarray:
    """Histogram of the first committed token over `trials` blocks of k drafts sampled from q."""
    rng = np.random.default_rng(seed)
    drafts = rng.choice(VOCAB, size=(trials, k), p=q / q.sum())  # x_i ~ q, vectorised
    P = np.stack([p] * (k + 1))
    Q = np.stack([q] * k)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for row in drafts:
        n, nxt = rule(list(row), Q, P, rng)
        counts[row[0] if n >= 1 else nxt] += 1
    return counts


def passes(counts: np.ndarray, p: np.ndarray) -> bool:
    stat, df, crit = chi2_test(counts, p)
    return stat < crit


# -- the rules under test -----------------------------------------------------------------

def ratio(draft, q, p, rng):
    return accept_ratio(draft, q, p, rng)


def exact(draft, q, p, rng):
    return accept_exact_sample(draft, p, rng)


# -- deliberately broken rules: the same check must reject each of them ---------------------

def broken_resample_from_p(draft, q, p, rng):
    """On rejection, sample from p instead of the residual max(p - q, 0)."""
    for i, d in enumerate(draft):
        if rng.random() >= min(1.0, p[i, d] / q[i, d]):
            return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def broken_always_accept(draft, q, p, rng):
    return len(draft), sample(p[len(draft)], rng)


def broken_inverted_ratio(draft, q, p, rng):
    """Accept with min(1, q/p) (the ratio upside down), residual as usual."""
    for i, d in enumerate(draft):
        if p[i, d] <= 0 or rng.random() >= min(1.0, q[i, d] / p[i, d]):
            return i, sample(residual(p[i], q[i]), rng)
    return len(draft), sample(p[len(draft)], rng)


def broken_unnormalised_residual(draft, q, p, rng):
    """On rejection, sample from max(p - q, 0) + the rejected mass put back on the draft."""
    for i, d in enumerate(draft):
        if rng.random() >= min(1.0, p[i, d] / q[i, d]):
            r = np.maximum(p[i] - q[i], 0.0)
            r[d] += 1.0 - r.sum()
            return i, sample(r / r.sum(), rng)
    return len(draft), sample(p[len(draft)], rng)


def broken_exact_keep_with_p(draft, q, p, rng):
    """Exact-match done wrong: keep the draft token with probability p(x), else sample p."""
    for i, d in enumerate(draft):
        if rng.random() >= p[i, d]:
            return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def trials_for(broken: Rule, p: np.ndarray) -> int:
    nucleus = bool((p == 0).any())
    return NUCLEUS_INVERTED_TRIALS if broken is broken_inverted_ratio and nucleus else TRIALS


def broken_law(broken: Rule, p: np.ndarray, q: np.ndarray, draft: np.ndarray | None = None
               ) -> np.ndarray:
    """The exact distribution of the first committed token under a broken rule, drafts from
    `draft` (default q; the rules see q either way) and the same p, q at every position: only
    the first draft's acceptance decides the first token, so it is one law for any k."""
    d = q if draft is None else draft
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 0.0)
        inverse = np.where(p > 0, np.minimum(1.0, q / np.where(p > 0, p, 1.0)), 0.0)
    if broken is broken_resample_from_p:
        return d * ratio + (d * (1 - ratio)).sum() * p
    if broken is broken_always_accept:
        return d.copy()
    if broken is broken_inverted_ratio:
        return d * inverse + (d * (1 - inverse)).sum() * residual(p, q)
    if broken is broken_unnormalised_residual:
        law, r = d * ratio, np.maximum(p - q, 0.0)
        for x in range(VOCAB):  # a rejected x: r with the rejected mass put back on x
            put_back = r.copy()
            put_back[x] += 1.0 - r.sum()
            law = law + d[x] * (1 - ratio[x]) * put_back / put_back.sum()
        return law
    if broken is broken_exact_keep_with_p:
        return d * p + (d * (1 - p)).sum() * p
    raise ValueError(broken)


BROKEN_RATIO_RULES = [broken_resample_from_p, broken_always_accept, broken_inverted_ratio,
                      broken_unnormalised_residual]


@pytest.mark.parametrize("k", [1, 3])
def test_accept_ratio_first_token_is_distributed_as_p(pq, k):
    p, q = pq
    counts = first_token_counts(ratio, p, q, k)
    stat, df, crit = chi2_test(counts, p)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df}): {counts} vs {p * TRIALS}"
    # and not by accident: the draft distribution itself is clearly rejected
    assert not passes(counts, q)


@pytest.mark.parametrize("draft_kind", ["from_q", "mode_of_p", "unlikely"])
def test_accept_exact_sample_first_token_is_distributed_as_p(pq, draft_kind):
    """Drafts without probabilities (n-gram): whatever the draft, the first token is ~ p."""
    p, q = pq
    rule = exact
    if draft_kind != "from_q":
        tok = int(np.argmax(p)) if draft_kind == "mode_of_p" else int(np.argmin(p + (p == 0)))
        const = np.zeros(VOCAB)
        const[tok] = 1.0  # drafts are a deterministic token
        counts = first_token_counts(rule, p, const, 2)
    else:
        counts = first_token_counts(rule, p, q, 2)
    stat, df, crit = chi2_test(counts, p)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df}): {counts} vs {p * TRIALS}"


@pytest.mark.parametrize("broken", BROKEN_RATIO_RULES)
def test_chi_square_rejects_broken_ratio_rules(pq, broken):
    p, q = pq
    counts = first_token_counts(broken, p, q, 1, trials=trials_for(broken, p))
    stat, df, crit = chi2_test(counts, p)
    assert stat > crit, f"{broken.__name__} was not caught: chi2 {stat:.1f} < {crit:.1f}"


def test_chi_square_rejects_broken_exact_rule(pq):
    p, q = pq
    counts = first_token_counts(broken_exact_keep_with_p, p, q, 1)
    stat, df, crit = chi2_test(counts, p)
    assert stat > crit, f"chi2 {stat:.1f} < {crit:.1f}"


def test_residual():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.2, 0.5, 0.2, 0.1])
    np.testing.assert_allclose(residual(p, q), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(residual(p, p), p)  # p <= q everywhere: falls back to p
    r = residual(np.array([0.4, 0.4, 0.2]), np.array([0.1, 0.3, 0.6]))
    np.testing.assert_allclose(r, [0.75, 0.25, 0.0])


def test_accept_ratio_certain_cases():
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[0.0, 1.0, 0.0]])
    for _ in range(50):  # p(x) >= q(x): always accepted, then a bonus token from p[1]
        n, nxt = accept_ratio([1], q, p, rng)
        assert n == 1 and nxt in (0, 1, 2)
    p = np.array([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    for _ in range(50):  # p(x) = 0: always rejected, the correction is from the residual
        assert accept_ratio([1], q, p, rng) == (0, 0)
    # a draft token the draft distribution gave no mass to is rejected, not divided by zero
    q0 = np.array([[1.0, 0.0, 0.0]])
    p = np.array([[0.2, 0.8, 0.0], [1.0, 0.0, 0.0]])
    assert accept_ratio([1], q0, p, rng) == (0, 1)


def test_accept_ratio_at_its_boundaries():
    """Accept x iff u < p(x)/q(x) for u in [0, 1): a token the verifier gives no mass (outside
    its top-p nucleus) is rejected even on the draw u = 0.0, and u equal to the ratio rejects."""
    q = np.array([[0.25, 0.5, 0.25]])
    p = np.array([[0.75, 0.0, 0.25], [0.0, 0.0, 1.0]])
    # p(1) = 0: rejected on u = 0.0; the correction from the residual [0.5, 0, 0] / 0.5
    assert accept_ratio([1], q, p, Draws(0.0, 0.9)) == (0, 0)
    p = np.array([[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]])  # p(1)/q(1) = 0.5, exactly
    assert accept_ratio([1], q, p, Draws(0.5 - 2**-53, 0.1)) == (1, 2)  # just below: kept
    assert accept_ratio([1], q, p, Draws(0.5, 0.1)) == (0, 0)  # at the ratio: rejected


def test_accept_greedy():
    from reference_rules import accept_greedy

    assert accept_greedy([3, 4, 5], [3, 4, 5, 6]) == (3, 6)
    assert accept_greedy([3, 9, 5], [3, 4, 5, 6]) == (1, 4)
    assert accept_greedy([], [7]) == (0, 7)
    assert accept_greedy([1], [2, 9]) == (0, 2)


def test_sample_matches_distribution_and_skips_zero_mass():
    rng = np.random.default_rng(5)
    p = np.array([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    counts = np.bincount([sample(p, rng) for _ in range(20_000)], minlength=len(p))
    stat, df, crit = chi2_test(counts, p)
    assert stat < crit
    assert counts[[0, 2, 5]].sum() == 0


def test_make_rng_is_seeded_per_stream():
    a = make_rng(SamplingParams(1.0, seed=7), 0).random(3)
    assert np.array_equal(a, make_rng(SamplingParams(1.0, seed=7), 0).random(3))
    assert not np.array_equal(a, make_rng(SamplingParams(1.0, seed=7), 1).random(3))


# -- top-p ----------------------------------------------------------------------------------

@pytest.mark.parametrize("p,top_p,kept", [
    ([0.5, 0.3, 0.15, 0.05], 0.5, [0]),  # the top token alone reaches 0.5
    ([0.5, 0.3, 0.15, 0.05], 0.7, [0, 1]),
    ([0.5, 0.3, 0.15, 0.05], 0.9, [0, 1, 2]),
    ([0.5, 0.3, 0.15, 0.05], 1.0, [0, 1, 2, 3]),
    ([0.05, 0.15, 0.5, 0.3], 0.7, [2, 3]),  # order of the vocabulary does not matter
    ([0.9, 0.05, 0.05], 0.1, [0]),  # always keeps the top token
    ([0.25, 0.25, 0.25, 0.25], 0.6, [0, 1, 2]),  # ties: a minimal set, by index
])
def test_top_p_filter_keeps_minimal_nucleus(p, top_p, kept):
    p = np.array(p)
    out = top_p_filter(p[None], top_p)[0]
    assert sorted(np.flatnonzero(out).tolist()) == kept
    np.testing.assert_allclose(out.sum(), 1.0)
    np.testing.assert_allclose(out[kept], p[kept] / p[kept].sum())  # renormalised, same ratios


def test_top_p_filter_rows_are_independent():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.34, 0.33, 0.33]])
    out = top_p_filter(p, 0.75)
    assert (out > 0).tolist() == [[True, True, False], [False, False, True],
                                  [True, True, True]]


def test_probs_from_logits_temperature_and_top_p():
    logits = mx.array([[2.0, 1.0, 0.0, -1.0]])
    p1 = probs_from_logits(logits, SamplingParams(1.0))[0]
    want = np.exp([2.0, 1.0, 0.0, -1.0])
    np.testing.assert_allclose(p1, want / want.sum(), rtol=1e-5)
    p2 = probs_from_logits(logits, SamplingParams(2.0))[0]
    want2 = np.exp([1.0, 0.5, 0.0, -0.5])
    np.testing.assert_allclose(p2, want2 / want2.sum(), rtol=1e-5)
    p3 = probs_from_logits(logits, SamplingParams(1.0, top_p=0.8))[0]
    assert p3[2] == p3[3] == 0.0 and abs(p3.sum() - 1) < 1e-9
    assert p1.dtype == np.float64
    with pytest.raises(ValueError):
        probs_from_logits(logits, SamplingParams(0.0))


# -- the whole loop -------------------------------------------------------------------------

# whole-loop samples of a check (the power test says why that is enough: at 300 each broken
# law there is caught with chance >= 0.9998, at 400 it was 1.0; 200 would drop the exact-match
# one to 0.99)
LOOP_SAMPLES = 300


def exact_joint(verifier_model) -> np.ndarray:
    """p(t1, t2) = p(t1) * p(t2 | t1), by forwards of the verifier (no sampling involved)."""
    p1 = next_probs(verifier_model, PROMPT)
    joint = np.zeros((VOCAB, VOCAB))
    for t1 in range(VOCAB):
        joint[t1] = p1[t1] * next_probs(verifier_model, PROMPT + [t1])
    return joint


def first_two(events) -> tuple[list[int], int, int]:
    """A generation's first two committed tokens, and its blocks' accepted and drafted totals
    up to the block that committed the second: the loop is closed there (its `finally` runs),
    as the blocks after it cannot change those two tokens (a third of the blocks of a
    max_tokens=3 sample were spent after them)."""
    from macfleet.engine.events import BlockDone, TokensCommitted

    tokens: list[int] = []
    accepted = drafted = 0
    try:
        for ev in events:
            if isinstance(ev, TokensCommitted):
                tokens.extend(ev.tokens)
            elif isinstance(ev, BlockDone):
                accepted, drafted = accepted + ev.accepted, drafted + ev.drafted
                if len(tokens) >= 2:
                    break
    finally:
        events.close()
    assert len(tokens) >= 2, tokens
    return tokens[:2], accepted, drafted


def loop_joint_counts(verifier_model, proposer: Proposer, n: int, seed0: int) -> np.ndarray:
    verifier = Verifier(verifier_model)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for i in range(n):
        (t1, t2), _, _ = first_two(speculative_generate(
            verifier, proposer, PROMPT, params=SamplingParams(1.0, seed=seed0 + i),
            max_tokens=3, controller=make_controller(2)))
        counts[t1, t2] += 1
    return counts


@pytest.mark.slow  # whole-loop samples
def test_loop_first_two_tokens_match_verifier_joint(models):
    """With max_tokens=3 and k=2, the first block drafts 2 tokens: both committed tokens pass
    through the ratio test (or its residual), and the second also through the bonus path."""
    target = exact_joint(models[0])
    proposer = ModelProposer(models[1], "draft:tiny")
    counts = loop_joint_counts(models[0], proposer, LOOP_SAMPLES, seed0=10_000)
    stat, df, crit = chi2_test(counts, target)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"
    # the draft really drafted with probabilities, and was sometimes rejected
    q1 = next_probs(models[1], PROMPT)
    assert not passes(counts.sum(axis=1), q1)


@pytest.mark.slow  # whole-loop samples
def test_loop_check_catches_a_broken_rule(models, monkeypatch):
    """The same loop check fails when the loop's ratio rule resamples from p on rejection."""
    monkeypatch.setattr("macfleet.engine.pipeline.rejection_rows", lambda p_, q_: p_)
    target = exact_joint(models[0])
    proposer = ModelProposer(models[1], "draft:tiny")
    counts = loop_joint_counts(models[0], proposer, LOOP_SAMPLES, seed0=10_000)
    stat, df, crit = chi2_test(counts, target)
    assert stat > crit, f"the broken loop was not caught: chi2 {stat:.1f} < {crit:.1f}"


def broken_loop_law(models, broken: Rule, draft: int | None = None) -> np.ndarray:
    """The exact joint law of the loop's first two tokens under a broken rule: each is the first
    token of a block (or a block's second draft, judged alike), so p(t1, t2) = law1(t1) *
    law2(t2 | t1), each `broken_law` of the verifier's p and the draft model's q at that
    context (`draft`: the fixed token an exact-match drafter proposes instead)."""
    def law(ctx):
        p, q = next_probs(models[0], ctx), next_probs(models[1], ctx)
        d = None if draft is None else np.eye(VOCAB)[draft]
        return broken_law(broken, p, q, d)

    first = law(PROMPT)
    return np.stack([first[t] * law(PROMPT + [t]) for t in range(VOCAB)])


def test_each_draw_count_has_the_power_to_catch_each_broken_rule(pq):
    """The chance (`chi2_power`, simulated) that each check rejects a broken rule's exact
    distribution is at least POWER with the draws the check takes: the host checks (each rule,
    TRIALS; the inverted ratio under a nucleus, NUCLEUS_INVERTED_TRIALS, and the "distributed as
    p" checks at top_p=1 catch it with TRIALS), the device checks (the rules a device row could
    break, DEVICE_TRIALS) and the "not the draft's q" checks."""
    p, q = pq
    for broken in BROKEN_RATIO_RULES + [broken_exact_keep_with_p]:
        n = trials_for(broken, p)
        assert chi2_power(p, broken_law(broken, p, q), n) >= POWER, (broken.__name__, n)
        if broken is not broken_inverted_ratio:
            assert chi2_power(p, broken_law(broken, p, q), DEVICE_TRIALS) >= POWER, broken
    if not (p == 0).any():
        assert chi2_power(p, broken_law(broken_inverted_ratio, p, q), TRIALS) >= POWER
    assert chi2_power(q, p, min(TRIALS, DEVICE_TRIALS)) >= POWER  # not passes(counts, q)


def test_the_loop_checks_have_the_power_to_catch_a_broken_rule(models):
    """As above for the whole loop: a rejection resampled from p (LOOP_SAMPLES, for the loop
    and its broken twin), the exact-match path keeping its draft with chance p(x) (half), and
    the draft model's own q1 told apart from the loop's first token."""
    target = exact_joint(models[0])
    resampled = broken_loop_law(models, broken_resample_from_p)
    assert chi2_power(target, resampled, LOOP_SAMPLES) >= POWER
    mode = int(np.argmax(target.sum(axis=1)))
    kept = broken_loop_law(models, broken_exact_keep_with_p, draft=mode)
    assert chi2_power(target, kept, LOOP_SAMPLES // 2) >= POWER
    q1 = next_probs(models[1], PROMPT)
    assert chi2_power(q1, target.sum(axis=1), LOOP_SAMPLES) >= POWER  # the loop's q1 check


class FixedDraft(Proposer):
    """A draft without probabilities (like n-gram): always the same tokens."""

    name = "fixed"

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens

    def propose(self, context, k):
        return Draft(self.tokens[:k])


@pytest.mark.slow  # whole-loop samples
def test_loop_exact_match_path_first_two_tokens(models):
    target = exact_joint(models[0])
    mode = int(np.argmax(target.sum(axis=1)))
    counts = loop_joint_counts(models[0], FixedDraft((mode, mode)), LOOP_SAMPLES // 2,
                               seed0=50_000)
    stat, df, crit = chi2_test(counts, target)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"


def test_acceptance_module_is_pure():
    """The rules are functions of their inputs and the rng: same seed, same decisions."""
    p = np.array([[0.2, 0.3, 0.5], [0.3, 0.3, 0.4]])
    q = np.array([[0.6, 0.2, 0.2]])
    a = [acceptance.accept_ratio([0], q, p, np.random.default_rng(9)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


# Upper quantiles of chi-square(df), from published tables (NIST/SEMATECH e-Handbook of
# Statistical Methods, 1.3.6.7.4, "Critical values of the chi-square distribution", upper tail;
# the same three decimals as scipy.stats.chi2.isf). alpha -> {df: critical value}.
CHI2_TABLE = {
    0.001: {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
            8: 26.124, 9: 27.877, 10: 29.588, 15: 37.697, 20: 45.315, 25: 52.620,
            30: 59.703, 40: 73.402, 50: 86.661, 60: 99.607, 70: 112.317, 80: 124.839,
            90: 137.208, 100: 149.449},
    0.05: {1: 3.841, 2: 5.991, 3: 7.815, 10: 18.307, 30: 43.773, 100: 124.342},
}


def test_chi_square_helper():
    """The critical values are the tabulated ones (to the table's three decimals), computed
    without scipy so this runs in CI; and the test built on them rejects at its intended rate."""
    from engine_testkit import ALPHA, chi2_critical, chi2_sf

    for alpha, table in CHI2_TABLE.items():
        for df, want in table.items():
            assert abs(chi2_critical(df, alpha) - want) <= 0.0005 + 1e-9, (alpha, df)
            assert chi2_sf(want, df) == pytest.approx(alpha, rel=2e-3)
    assert chi2_sf(0.0, 3) == 1.0 and 0.0 <= chi2_sf(1e4, 3) < 1e-300
    # closed forms: df=2 is exponential (sf = e^-x/2), df=1 is a squared normal (sf = erfc)
    for x in (0.01, 0.5, 3.0, 12.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(np.exp(-x / 2), rel=1e-12)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10)
    assert ALPHA == 0.001
    with pytest.raises(ValueError):
        chi2_critical(0)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    rng = np.random.default_rng(3)
    rejections = sum(
        not passes(np.bincount(rng.choice(4, size=2000, p=p), minlength=4), p)
        for _ in range(200))
    assert rejections <= 3  # about 0.001 * 200 expected


# -- the same rules on the device (engine/pipeline.py: what the loops run) -------------------

DEVICE_TRIALS = 1_500  # each trial is a small graph (the power test says why that is enough)


def device_rule(with_q: bool) -> Rule:
    """`sampled_outcome` as a Rule: logits log p at temperature 1 give back p; each call is one
    seeded block (seed from the trial's rng), so trials are independent draws."""
    from macfleet.engine.pipeline import sampled_outcome

    made: dict[int, tuple[np.ndarray, mx.array]] = {}  # the logits of a p, made once

    def rule(draft, q, p, rng):
        if id(p) not in made:
            made[id(p)] = (p, mx.array(np.log(np.maximum(p, 1e-30)).astype(np.float32)))
        logits = made[id(p)][1]
        seed = int(rng.integers(2**62))
        out = sampled_outcome(logits, draft, q if with_q else None, T1, seed, start=0)
        n, nxt = (int(v) for v in out.tolist())
        return n, nxt

    return rule


def device_counts(rule: Rule, p, q, k) -> np.ndarray:
    return first_token_counts(rule, p, q, k, trials=DEVICE_TRIALS)


# The device checks take one value of each dimension per run, not their product (the host
# checks above run the whole grid): a draft length (k) and a nucleus (top-p zeros in p) change
# independent things (how many rows, which values), and each trial here is a small graph.
@pytest.mark.slow  # DEVICE_TRIALS small graphs a run
@pytest.mark.parametrize("k,pq", [(1, 1.0), (3, 0.8)], indirect=["pq"])
def test_device_ratio_test_first_token_is_distributed_as_p(pq, k):
    p, q = pq
    counts = device_counts(device_rule(with_q=True), p, q, k)
    stat, df, crit = chi2_test(counts, p)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df}): {counts} vs {p * counts.sum()}"
    assert not passes(counts, q)


@pytest.mark.slow  # DEVICE_TRIALS small graphs
@pytest.mark.parametrize("pq", [0.8], indirect=True)
def test_device_exact_match_first_token_is_distributed_as_p(pq):
    p, q = pq
    counts = device_counts(device_rule(with_q=False), p, q, 2)
    stat, df, crit = chi2_test(counts, p)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"


@pytest.mark.slow  # DEVICE_TRIALS small graphs
@pytest.mark.parametrize("pq", [1.0], indirect=True)
def test_device_check_catches_a_broken_rejection_row(pq, monkeypatch):
    """The device check has power: resampling from p on rejection is caught."""
    p, q = pq
    monkeypatch.setattr("macfleet.engine.pipeline.rejection_rows", lambda p_, q_: p_)
    counts = device_counts(device_rule(with_q=True), p, q, 1)
    stat, df, crit = chi2_test(counts, p)
    assert stat > crit, f"the broken device rule was not caught: chi2 {stat:.1f} < {crit:.1f}"


def test_device_ratio_test_at_its_boundaries():
    """p(x) = 0 rejects on any draw; p(x) >= q(x) always accepts, then a bonus from p_k."""
    from macfleet.engine.pipeline import sampled_outcome

    q = np.array([[0.0, 1.0, 0.0]])
    sure = mx.array(np.log(np.array([[1e-30, 1.0, 1e-30], [1e-30, 1e-30, 1.0]])), dtype=mx.float32)
    never = mx.array(np.log(np.array([[1.0, 1e-30, 1e-30], [1e-30, 1e-30, 1.0]])), dtype=mx.float32)
    for seed in range(30):
        assert sampled_outcome(sure, [1], q, T1, seed, 0).tolist() == [1, 2]
        assert sampled_outcome(never, [1], q, T1, seed, 0).tolist() == [0, 0]
    q0 = np.array([[1.0, 0.0, 0.0]])  # the draft's own q gave its token no mass: rejected
    assert sampled_outcome(sure, [1], q0, T1, 3, 0).tolist()[0] == 0


def test_device_draws_are_keyed_by_position_not_by_block():
    """A position's draw depends on (seed, position) only: an exact-match block that drafts
    the tokens plain steps would sample commits exactly those tokens (same logits rows)."""
    from macfleet.engine.pipeline import sampled_outcome

    rng = np.random.default_rng(0)
    rows = mx.array(rng.normal(size=(4, 50)).astype(np.float32))
    plain = [sampled_outcome(rows[i : i + 1], (), None, T1, 77, start=5 + i).tolist()[1]
             for i in range(4)]
    block = sampled_outcome(rows, plain[:3], None, T1, 77, start=5).tolist()
    assert block == [3, plain[3]]
    other = [sampled_outcome(rows[i : i + 1], (), None, T1, 78, start=5 + i).tolist()[1]
             for i in range(4)]
    assert other != plain  # another seed, other draws (4 tokens of 50: a tie is ~1e-7)


def test_device_probs_match_the_host_transform():
    from macfleet.engine.sampling import device_probs

    logits = mx.array(np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32))
    for params in (SamplingParams(0.7), SamplingParams(1.3, top_p=0.6)):
        np.testing.assert_allclose(np.array(device_probs(logits, params)),
                                   probs_from_logits(logits, params), atol=2e-6)


BIG_VERIFY_MS = 200.0


@pytest.mark.slow  # whole-loop samples, each drafted by a draft-model agent's stream
def test_drafted_ahead_by_a_draft_agent_the_first_two_tokens_match_verifier_joint(models):
    """The draft model on the other end of a real socket (agents/draft_service.py), drafting
    ahead and pushing its tokens with their probabilities: the loop's committed tokens keep the
    verifier's joint distribution, and the drafts really were used (and sometimes rejected)."""
    from types import SimpleNamespace

    from agents.draft_service import DraftAheadService
    from agents.remote_stream import StreamingProposer
    from bridge.transport import Server

    key = b"s" * 32
    svc = DraftAheadService(SimpleNamespace(model=models[1], vocab_size=VOCAB, spec="q"),
                            serves="p")
    server = Server(lambda env, reply: svc.handle(env.msg, reply), key=key,
                    bind="tcp://127.0.0.1:*").start()
    try:
        proposer = StreamingProposer(f"tcp://127.0.0.1:{server.port}", key=key, model="p")
        drafted = []
        real_finish, real_observe = proposer.finish, proposer.observe
        proposer.finish = lambda: drafted.append(len(d := real_finish())) or d
        # verify priced as a big verifier's (the regime a draft agent is for), not this tiny
        # model's ~1 ms: the proposer then waits for the drafts due, as it would there, instead
        # of verifying without them whenever the other worker's load slows the agent (23 of
        # 400 samples drafted in one quiet two-worker run: the check below failed)
        proposer.seed_verify_costs({L: BIG_VERIFY_MS for L in range(1, 8)})
        proposer.observe = lambda d, a, _ms, verified=None: real_observe(d, a, BIG_VERIFY_MS,
                                                                         verified)
        counts = loop_joint_counts(models[0], proposer, LOOP_SAMPLES, seed0=30_000)
        stat, df, crit = chi2_test(counts, exact_joint(models[0]))
        assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"
        # drafts really came over the socket, in most blocks
        assert sum(drafted) > LOOP_SAMPLES // 2, sum(drafted)
        assert not passes(counts.sum(axis=1), next_probs(models[1], PROMPT))
    finally:
        proposer.close()
        server.close()
        svc.close()
