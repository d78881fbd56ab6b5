"""engine/sampling.py's edges: what a request's parameters may be, the host draw at its
boundaries, and the keys a seeded generation draws with (issue 36: the mutants that survived
tests/engine/test_sampling_lossless.py).

The chi-square tests of test_sampling_lossless.py pin the distributions; these pin what they
cannot see: the exact limits of the parameters, a draw at u = 0 or at the top of the last
bucket, rows of a [L, V] batch normalised one by one, and the seeded keys themselves (a seeded
request must draw the same tokens in every loop and every release, so the key function is a
contract: SplitMix64, checked against its published outputs).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_testkit import Draws

from macfleet.engine import sampling
from macfleet.engine.sampling import (GREEDY, MAX_SEED, MIN_TEMPERATURE, SamplingParams,
                                      device_probs, generation_seed, make_rng,
                                      position_keys, probs_from_logits, sample, top_p_filter)

# -- the parameters -------------------------------------------------------------------------


def test_greedy_is_temperature_zero_and_the_default():
    assert GREEDY == SamplingParams() == SamplingParams(0.0, 1.0, None)
    assert GREEDY.greedy and GREEDY.temperature == 0.0 and GREEDY.top_p == 1.0
    assert GREEDY.seed is None
    assert not SamplingParams(0.5).greedy


def test_temperatures_below_the_floor_are_greedy_and_the_floor_is_not():
    assert MIN_TEMPERATURE == 1e-5
    for t in (1e-38, 1e-6, 9.99e-6):
        p = SamplingParams(t)
        assert p.greedy and p.temperature == 0.0, t
    for t in (1e-5, 2e-5, 1e-4, 0.7):
        p = SamplingParams(t)
        assert not p.greedy and p.temperature == t, t


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1e-9}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"temperature": float("inf")}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.0 + 1e-9}, r"top_p must be in \(0, 1\]"),
    ({"seed": -1}, "seed must be an integer in 0..9223372036854775807"),
    ({"seed": 2**63}, "seed must be an integer in 0..9223372036854775807"),
    ({"seed": 1.0}, "seed must be an integer"),
    ({"seed": "1"}, "seed must be an integer"),
])
def test_bad_parameters_are_refused_with_their_limits(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**{"temperature": 1.0, **kwargs})


def test_parameters_at_their_limits_are_taken():
    assert MAX_SEED == 2**63 - 1  # numpy's generators take 0..2**63 - 1
    for seed in (0, 1, 2**63 - 1, None):
        assert SamplingParams(1.0, seed=seed).seed == seed
    assert SamplingParams(1.0, top_p=1.0).top_p == 1.0
    assert SamplingParams(1.0, top_p=1e-9).top_p == 1e-9
    np.random.default_rng([2**63 - 1, 0])  # the largest seed is one numpy takes


# -- logits -> probabilities ----------------------------------------------------------------


def test_rows_are_transformed_and_normalised_one_by_one():
    """A [L, V] block: each row is its own softmax and its own nucleus (never normalised
    across rows), on the host and on the device alike."""
    logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0], [1.0, 0.5, 0.25, 0.0]],
                      dtype=np.float32)
    for top_p in (1.0, 0.7):
        params = SamplingParams(1.0, top_p=top_p)
        host = probs_from_logits(mx.array(logits), params)
        dev = np.array(device_probs(mx.array(logits), params))
        for i in range(3):
            want = probs_from_logits(mx.array(logits[i : i + 1]), params)[0]
            np.testing.assert_allclose(host[i], want, rtol=1e-12)
            np.testing.assert_allclose(dev[i], want, atol=2e-6)
        np.testing.assert_allclose(host.sum(axis=1), 1.0, rtol=1e-6)
    p = top_p_filter(np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7],
                               [0.4, 0.4, 0.1, 0.1]]), 0.75)
    np.testing.assert_allclose(p, [[0.625, 0.375, 0.0, 0.0], [0.125, 0.0, 0.0, 0.875],
                                   [0.5, 0.5, 0.0, 0.0]], rtol=1e-12)


def test_top_p_1_truncates_nothing_and_a_nucleus_may_reach_top_p_exactly():
    """top_p = 1 keeps a token of any mass, however small (no nucleus is applied); a set whose
    mass is exactly top_p is a nucleus (equal logits give exact probabilities)."""
    tail = mx.array([[0.0, -21.0]])  # p(1) ~ 7.6e-10: below float32's resolution of 1 - p
    assert np.array(device_probs(tail, SamplingParams(1.0)))[0, 1] > 0
    assert probs_from_logits(mx.array([[0.0, -40.0]]), SamplingParams(1.0))[0, 1] > 0
    flat = mx.zeros((1, 4))  # p = 0.25 each, exactly
    for f in (probs_from_logits, device_probs):
        for top_p, kept in ((0.5, 2), (0.75, 3), (0.25, 1), (1.0, 4)):
            p = np.array(f(flat, SamplingParams(1.0, top_p=top_p)))[0]
            assert (p > 0).sum() == kept and abs(p.sum() - 1) < 1e-6, (f.__name__, top_p, p)


def test_top_p_ties_are_kept_by_index_on_the_host():
    """Equal probabilities enter the nucleus in vocabulary order (a stable sort: numpy's default
    sort reorders ties in rows of more than 16 tokens), so the nucleus is one set."""
    out = top_p_filter(np.full((1, 40), 1 / 40), 0.49)[0]
    assert np.flatnonzero(out).tolist() == list(range(20))
    p = np.random.default_rng(0).integers(1, 4, size=64).astype(np.float64)
    p /= p.sum()
    order = sorted(range(64), key=lambda i: (-p[i], i))  # by probability, ties by index
    cum = np.cumsum(p[order])
    want = sorted(i for i, c, q in zip(order, cum, p[order]) if c - q < 0.6)
    assert 0 < (p[want] == p[want].min()).sum() < (p == p[want].min()).sum()  # a tie is cut
    assert np.flatnonzero(top_p_filter(p[None], 0.6)[0]).tolist() == want


def test_the_device_transform_refuses_greedy_like_the_host():
    logits = mx.array([[1.0, 2.0]])
    for f in (probs_from_logits, device_probs):
        with pytest.raises(ValueError, match="^greedy decoding has no sampling distribution; "
                                             "use argmax$"):
            f(logits, GREEDY)


# -- the host draw --------------------------------------------------------------------------


def test_sample_at_its_boundaries():
    """Token i is drawn for u * total in [c_{i-1}, c_i): u = 0 never draws a token without
    mass; the last token is reachable; an unnormalised row is scaled by its total; and the id
    stays in range even at the very top (u * total rounding up to the total)."""
    assert sample(np.array([0.0, 1.0]), Draws(0.0)) == 1
    assert sample(np.array([0.0, 0.0, 0.5, 0.5]), Draws(0.0)) == 2
    assert sample(np.array([0.5, 0.5]), Draws(0.5 - 2**-53)) == 0
    assert sample(np.array([0.5, 0.5]), Draws(0.5)) == 1
    assert sample(np.array([0.5, 0.5]), Draws(0.75)) == 1
    assert sample(np.array([1.0, 3.0]), Draws(0.2)) == 0  # 0.8 of 4
    assert sample(np.array([1.0, 3.0]), Draws(0.3)) == 1  # 1.2 of 4
    assert sample(np.array([0.25, 0.75]), Draws(1.0)) == 1


def test_make_rng_streams_and_the_default_stream():
    seeded = SamplingParams(1.0, seed=5)
    assert make_rng(seeded).random() == make_rng(seeded, 0).random()
    assert make_rng(seeded, 0).random() == np.random.default_rng([5, 0]).random()
    assert make_rng(seeded, 1).random() == np.random.default_rng([5, 1]).random()
    assert make_rng(SamplingParams(1.0)).random() != make_rng(SamplingParams(1.0)).random()


# -- the keys a seeded generation draws with ------------------------------------------------

# SplitMix64 (Steele, Lea, Flood 2014) from state 0: its first four outputs, as published with
# Vigna's splitmix64.c (xoshiro's seeding generator). `_splitmix(x)` is one step from state x.
SPLITMIX_FROM_0 = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F,
                   0xF88BB8A8724C81EC]
GOLDEN = 0x9E3779B97F4A7C15


def test_splitmix_is_the_published_generator():
    states = [(GOLDEN * i) % 2**64 for i in range(4)]
    assert [sampling._splitmix(s) for s in states] == SPLITMIX_FROM_0


def _keys(seed, stream, start, n, purpose):
    s = sampling._splitmix
    base = s(s(s(seed) ^ stream) ^ purpose)
    hs = [s(base ^ (start + i)) for i in range(n)]
    return [[h >> 32, h & 0xFFFFFFFF] for h in hs]


@pytest.mark.parametrize("seed,stream,start,n,purpose", [
    (0, 0, 0, 3, 0), (7, 0, 5, 4, 1), (MAX_SEED, 3, 2**40, 2, 0), (12345, 1, 17, 1, 1),
])
def test_position_keys_are_splitmix_of_seed_stream_purpose_and_position(seed, stream, start,
                                                                       n, purpose):
    keys = position_keys(seed, stream, start, n, purpose)
    assert keys.dtype == mx.uint32 and keys.shape == (n, 2)
    assert np.array(keys).tolist() == _keys(seed, stream, start, n, purpose)
    # counter-based: position t's key does not depend on where its block started
    assert np.array(position_keys(seed, stream, start + 1, n - 1, purpose)).tolist() == \
        np.array(keys).tolist()[1:]


def test_position_keys_differ_by_seed_stream_purpose_and_position():
    rows = [np.array(position_keys(*args)).tolist()[0] for args in
            [(1, 0, 0, 1, 0), (2, 0, 0, 1, 0), (1, 1, 0, 1, 0), (1, 0, 1, 1, 0), (1, 0, 0, 1, 1)]]
    assert len({tuple(r) for r in rows}) == len(rows)
    assert position_keys(3, 0, 9, 0, 0).shape == (0, 2)


def test_generation_seed_is_the_requests_or_a_fresh_one():
    assert generation_seed(SamplingParams(1.0, seed=0)) == 0
    assert generation_seed(SamplingParams(1.0, seed=2**63 - 1)) == 2**63 - 1
    fresh = [generation_seed(SamplingParams(1.0)) for _ in range(4)]
    assert all(isinstance(s, int) and 0 <= s <= MAX_SEED for s in fresh)
    assert len(set(fresh)) == 4  # 63-bit draws: a repeat is ~1e-18
    SamplingParams(1.0, seed=fresh[0])  # a valid seed for a request
