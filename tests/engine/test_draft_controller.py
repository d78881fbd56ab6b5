"""The adaptive draft length: the cost model, and the controller fed synthetic block streams."""

from __future__ import annotations

import numpy as np
import pytest

from macfleet.engine.controller import (DEFAULT_K_MAX, DEFAULT_PROBE_K, DEFAULT_PROBE_MAX,
                                        DEFAULT_PROBE_MIN, AdaptiveDraftLength, FixedDraftLength,
                                        best_k, expected_tokens, make_controller)


@pytest.mark.parametrize("alpha,k,want", [
    (0.5, 0, 1.0),
    (0.5, 1, 1.5),
    (0.5, 3, 1.875),  # 1 + 0.5 + 0.25 + 0.125
    (0.0, 5, 1.0),
    (1.0, 4, 5.0),
    (0.9, 2, 2.71),
    (0.8, 10, (1 - 0.8**11) / 0.2),
])
def test_expected_tokens(alpha, k, want):
    assert expected_tokens(alpha, k) == pytest.approx(want)


def test_expected_tokens_is_the_mean_of_a_truncated_geometric_run():
    rng = np.random.default_rng(0)
    alpha, k = 0.7, 5
    runs = []
    for _ in range(20_000):
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        runs.append(n + 1)  # accepted drafts plus the verifier's own token
    assert np.mean(runs) == pytest.approx(expected_tokens(alpha, k), rel=0.01)


@pytest.mark.parametrize("draft_ms", [0.5, 2.0, 10.0])
def test_best_k_is_zero_when_nothing_is_accepted(draft_ms):
    assert best_k(0.0, draft_ms, verify_a=20.0, verify_b=1.0, k_max=12) == 0


def test_best_k_is_zero_for_free_useless_drafts_with_flat_verify():
    assert best_k(0.0, 0.0, verify_a=20.0, verify_b=0.0, k_max=12) == 0


def test_best_k_is_large_for_cheap_accurate_drafts():
    k = best_k(0.9, draft_ms=0.2, verify_a=20.0, verify_b=0.5, k_max=12)
    assert k >= 8
    assert best_k(0.99, 0.0, 20.0, 0.0, 12) == 12


def test_best_k_shrinks_as_drafts_get_expensive():
    ks = [best_k(0.8, d, 20.0, 1.0, 12) for d in (0.1, 2.0, 5.0, 10.0, 40.0)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    assert ks[-1] == 0


def test_best_k_maximises_rate():
    """Brute force: no k beats the chosen one by more than the 2% margin."""
    for alpha in (0.2, 0.5, 0.7, 0.9):
        for d in (0.5, 3.0, 8.0):
            k = best_k(alpha, d, 20.0, 1.5, 12)

            def rate(j):
                return expected_tokens(alpha, j) / (j * d + 20.0 + 1.5 * j)

            assert all(rate(j) <= rate(k) * 1.0201 for j in range(13)), (alpha, d, k)


def simulate(ctl, n, alpha_of_block, draft_ms_per_token, verify_a=20.0, verify_b=1.0, seed=0):
    """Feed n blocks to `ctl`; acceptance is a geometric run with the block's alpha."""
    rng = np.random.default_rng(seed)
    ks = []
    for i in range(n):
        k = ctl.next_k()
        assert 0 <= k <= ctl.k_max
        ks.append(k)
        acc = 0
        while acc < k and rng.random() < alpha_of_block(i):
            acc += 1
        ctl.observe(k, acc, draft_ms_per_token * k, verify_a + verify_b * k)
    return ks


def test_adaptive_backs_off_to_plain_decoding_for_a_useless_proposer():
    ctl = AdaptiveDraftLength()
    ks = simulate(ctl, 300, lambda i: 0.0, draft_ms_per_token=3.0)
    assert ks[0] > 0  # optimistic start: speculation is tried first
    first_zero = ks.index(0)
    assert first_zero < 20
    tail = ks[first_zero:]
    assert sum(k > 0 for k in tail) / len(tail) < 0.05  # almost all plain decoding
    assert all(k in (0, DEFAULT_PROBE_K) for k in tail)  # only short probes
    assert ctl.alpha < 0.2


def test_adaptive_probes_with_a_growing_interval():
    ctl = AdaptiveDraftLength()
    ks = simulate(ctl, 400, lambda i: 0.0, draft_ms_per_token=3.0)
    first_zero = ks.index(0)
    probes = [i for i in range(first_zero, len(ks)) if ks[i] > 0]
    assert len(probes) >= 4, probes
    gaps = np.diff([first_zero - 1, *probes]).tolist()
    # the first probe comes soon after backing off, then the interval doubles up to the cap
    assert gaps[0] <= DEFAULT_PROBE_MIN + 1, gaps
    assert gaps == sorted(gaps), gaps
    assert gaps[1] > gaps[0] and max(gaps) <= DEFAULT_PROBE_MAX + 1, gaps
    assert ctl.probe_interval == DEFAULT_PROBE_MAX


def test_adaptive_resumes_speculating_when_drafts_start_matching():
    ctl = AdaptiveDraftLength()
    ks = simulate(ctl, 400, lambda i: 0.0 if i < 60 else 0.95, draft_ms_per_token=1.0)
    assert ks[59] == 0 or ks[59] == DEFAULT_PROBE_K
    assert np.mean(ks[-50:]) >= 6, ks[-50:]


def test_adaptive_uses_long_blocks_for_a_cheap_accurate_proposer():
    ctl = AdaptiveDraftLength()
    ks = simulate(ctl, 200, lambda i: 0.9, draft_ms_per_token=0.3)
    assert np.mean(ks[-50:]) >= 6, ks[-50:]
    assert ctl.alpha == pytest.approx(0.9, abs=0.08)


def test_adaptive_fits_the_verify_cost_line():
    ctl = AdaptiveDraftLength()
    for k in [4, 1, 2, 6, 3, 0, 5] * 3:
        ctl.observe(k, min(k, 1), 2.0 * k, 10.0 + 2.5 * k)  # v(L) = 10 + 2.5 (L - 1)
    assert ctl.verify_a == pytest.approx(10.0)
    assert ctl.verify_b == pytest.approx(2.5)
    assert ctl.draft_ms == pytest.approx(2.0)


def test_adaptive_respects_k_max():
    ctl = AdaptiveDraftLength(k_max=3)
    ks = simulate(ctl, 100, lambda i: 1.0, draft_ms_per_token=0.0)
    assert max(ks) == 3


def test_fixed_and_factory():
    ctl = make_controller(5)
    assert isinstance(ctl, FixedDraftLength)
    ctl.observe(5, 0, 1.0, 1.0)
    assert ctl.next_k() == 5
    assert make_controller("auto").k_max == DEFAULT_K_MAX
