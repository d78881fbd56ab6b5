"""The device-side block decisions (engine/pipeline.py, read through engine/block.py by the
serving engine): greedy and sampled acceptance of chains and trees as device ops, each agreeing
with its host rule; and the pieces a draft made ahead is re-rooted and rolled back with
(tree.reroot for agents/draft_stream.py's `take`, the n-gram index's rollback)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.draft_stream import Ahead, take
from reference_rules import accept_greedy
from macfleet.engine.pipeline import (greedy_outcome, gumbel_pick, rejection_rows,
                                      sampled_outcome, sampled_tree_outcome)
from macfleet.engine.proposers import Draft
from macfleet.engine.proposers.ngram import NgramProposer
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.tree import reroot

# -- the device-side decisions ------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_greedy_outcome_is_accept_greedy(k, pad, seed):
    """The device's (accepted, next) is the host rule's, for every draft and any padding."""
    rng = np.random.default_rng(seed)
    vocab = 5  # few ids: drafts often match
    logits = rng.normal(size=(k + 1 + pad, vocab)).astype(np.float32)
    target = logits.argmax(axis=-1)[: k + 1]
    drafts = [int(t) if rng.random() < 0.7 else int(rng.integers(vocab)) for t in target[:k]]
    got = greedy_outcome(mx.array(logits), drafts).tolist()
    assert tuple(got) == accept_greedy(drafts, target.tolist())


# -- what a draft made ahead relies on ------------------------------------------------------


def test_ngram_rolls_back_a_guessed_tail_to_the_same_index():
    rng = np.random.default_rng(3)
    for _ in range(50):
        common = rng.integers(0, 4, size=rng.integers(1, 30)).tolist()
        a = common + rng.integers(0, 4, size=rng.integers(0, 8)).tolist()
        b = common + rng.integers(0, 4, size=rng.integers(0, 8)).tolist()
        p, q = NgramProposer(), NgramProposer()
        p.start(None)
        q.start(None)
        p.propose(a, 3)
        p.propose(b, 3)  # diverged: the tail of `a` is forgotten, not the whole index rebuilt
        q.propose(b, 3)
        assert p._seen == q._seen
        assert p._index == q._index
        assert p.propose(b, 5).tokens == q.propose(b, 5).tokens


def test_reroot_keeps_the_subtree_under_the_guessed_token():
    #        -1: 5 (0) -> 6 (1) -> 7 (2)
    #        -1: 8 (3) -> 9 (4);  0 -> 10 (5)
    toks, par = (5, 6, 7, 8, 9, 10), (-1, 0, 1, -1, 3, 0)
    assert reroot(toks, par, 5) == ([6, 7, 10], [-1, 0, -1], [1, 2, 5])
    assert reroot(toks, par, 8) == ([9], [-1], [4])
    assert reroot(toks, par, 6) == ([], [], [])  # 6 is no top-level guess
    assert reroot((4, 5, 6), None, 4) == ([5, 6], [-1, 0], [1, 2])  # a chain stays a chain
    assert reroot((4, 5, 6), None, 3) == ([], [], [])


def test_a_draft_made_ahead_is_taken_only_on_its_path_and_rerooted_with_its_rows():
    """agents/draft_stream.py `take` (a proposer agent's tree sessions): the draft made from
    context + branch is the next block's when that branch was committed and the bonus was one of
    its top-level guesses; re-rooted under that guess, with its rows and parents, cut to k."""
    p = np.eye(4)[[1, 2, 3]]
    tree = Ahead(5, (1, 2), Draft((9, 3, 4), p, parents=(-1, 0, 1)))
    out = take(tree, [0, 0, 1, 2, 9])
    assert out.tokens == (3, 4) and out.parents == (-1, 0) and out.draft_ms == 0.0
    assert np.array_equal(out.probs, p[[1, 2]])
    assert take(tree, [0, 0, 1, 2, 9], k=1).tokens == (3,)
    chain = take(Ahead(5, (1, 2), Draft((9, 3), p[:2])), [0, 0, 1, 2, 9])
    assert chain.tokens == (3,) and chain.parents is None  # a chain stays a chain
    assert take(tree, [0, 0, 1, 7, 9]) is None  # another path of the same length
    assert take(tree, [0, 0, 1, 2, 8]) is None  # the bonus was not its guess
    assert take(tree, [0, 1, 2, 9]) is None and take(None, [0]) is None


# -- the device-side rules, piece by piece (mutation testing of pipeline.py, issue 36) -------

T1 = SamplingParams(1.0)


def _log(p) -> mx.array:
    """Logits whose softmax at temperature 1 is p (a zero stays a zero: exp(-1e9) is 0)."""
    p = np.asarray(p, dtype=np.float64)
    return mx.array(np.where(p > 0, np.log(np.maximum(p, 1e-300)), -1e9).astype(np.float32))


def test_every_outcome_is_int32():
    """The outcome's next token feeds the next step's forward as a token id."""
    logits = mx.array(np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32))
    q = np.full((2, 6), 1 / 6)
    outs = [greedy_outcome(logits, []), greedy_outcome(logits, [1, 2]),
            sampled_outcome(logits, [], None, T1, 1, 0),
            sampled_outcome(logits, [1, 2], None, T1, 1, 0),
            sampled_outcome(logits, [1, 2], q, T1, 1, 0),
            sampled_tree_outcome(logits, [0], [-1], [0], T1, 1, 0),
            sampled_tree_outcome(logits, [0, 1, 2], [-1, 0, 0], [0, 1, 1], T1, 1, 0)]
    for out in outs:
        assert out.dtype == mx.int32 and out.shape == (2,)


def test_rejection_rows_are_the_residual_or_p_where_it_is_empty():
    p = mx.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    q = mx.array([[0.2, 0.5, 0.3], [0.2, 0.3, 0.5]])  # the second row: p == q, no residual
    np.testing.assert_allclose(np.array(rejection_rows(p, q)),
                               [[0.3, 0.0, 0.0], [0.2, 0.3, 0.5]], atol=1e-7)


def test_gumbel_pick_draws_each_row_from_its_normalised_weights():
    """An exact categorical draw: one row repeated 4000 times under 4000 keys follows the row
    (chi-square at p = 0.001)."""
    from engine_testkit import chi2_test

    from macfleet.engine.sampling import position_keys

    p = np.array([0.4, 0.3, 0.2, 0.1])
    n = 4000
    keys = position_keys(11, 0, 0, n, 0)
    rows = mx.array(np.tile(p, (n, 1)).astype(np.float32))
    got = gumbel_pick(rows, keys)
    assert got.shape == (n,) and got.dtype == mx.int32
    counts = np.bincount(np.array(got), minlength=len(p))
    stat, df, crit = chi2_test(counts, p)
    assert stat < crit, (counts, stat, crit)
    # and rows differ: each row draws from its own weights (here: certain ones)
    certain = mx.array(np.eye(4, dtype=np.float32)[[2, 0, 3]])
    assert gumbel_pick(certain, keys[:3]).tolist() == [2, 0, 3]


def test_device_ratio_test_keeps_drafts_the_verifier_likes_more_and_corrects_the_first_miss():
    """p(d) >= q(d) at every position keeps the whole block (any draw; each row's own d, its
    own p and q); a position where the verifier gives its draft no mass rejects it, and the
    correction comes from that position's residual (here all of it on token 1)."""
    d = [1, 2, 1]
    p = np.array([[0.0, 0.5, 0.5, 0.0]] * 3 + [[0.25] * 4])
    q = np.array([[0.7, 0.1, 0.1, 0.1]] * 3)  # q(d) = 0.1 < p(d) = 0.5; q(0) > p(0)
    for seed in range(10):
        n, nxt = sampled_outcome(_log(p), d, q, T1, seed, 7).tolist()
        assert n == 3 and 0 <= nxt < 4
    p_miss = p.copy()
    p_miss[1] = [0.5, 0.5, 0.0, 0.0]  # the second draft (2) has no mass at its position
    for seed in range(10):  # residual max(p - q, 0) = (0, 0.4, 0, 0)
        assert sampled_outcome(_log(p_miss), d, q, T1, seed, 7).tolist() == [1, 1]


def test_device_ratio_correction_comes_from_the_residual():
    """p = (0.5, 0.5, 0), q = (0, 1, 0), d = 1: kept half the time; when not, the residual
    max(p - q, 0) has all its mass on 0 (p itself would give 1 half the time)."""
    q = np.array([[0.0, 1.0, 0.0]])
    logits = _log([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    outs = [tuple(sampled_outcome(logits, [1], q, T1, seed, 0).tolist()) for seed in range(40)]
    assert set(outs) == {(1, 2), (0, 0)}


def test_device_ratio_test_is_seeded_per_position():
    """The accept draws come from the request's seed and the positions: the same seed decides
    the same (the keep rate here is one half, so unseeded draws would differ)."""
    q = np.array([[0.0, 1.0, 0.0]] * 2)
    logits = _log([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    a = [sampled_outcome(logits, [1, 1], q, T1, seed, 3).tolist() for seed in range(24)]
    b = [sampled_outcome(logits, [1, 1], q, T1, seed, 3).tolist() for seed in range(24)]
    assert a == b and len({tuple(x) for x in a}) > 1


def test_device_ratio_test_at_its_exact_boundaries(monkeypatch):
    """Keep d iff u * q(d) < p(d), u in [0, 1): u = 0 rejects a token outside the verifier's
    nucleus (p = 0), u * q(d) == p(d) rejects, u < p(d) / q(d) keeps even when q(d) < 1."""
    u_now = [0.0]
    monkeypatch.setattr(mx.random, "uniform",
                        lambda *a, **kw: mx.array(u_now[0], dtype=mx.float32))
    nucleus = SamplingParams(1.0, top_p=0.5)
    logits = mx.array([[2.0, 0.0, -2.0], [0.0, 0.0, 0.0]])  # top-p 0.5 keeps token 0 only
    q = np.array([[0.5, 0.0, 0.5]])
    assert sampled_outcome(logits, [2], q, nucleus, 1, 0).tolist()[0] == 0
    half = _log([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    u_now[0] = 0.5  # u * q(1) = 0.5 = p(1): rejected
    assert sampled_outcome(half, [1], np.array([[0.0, 1.0, 0.0]]), T1, 1, 0).tolist() == [0, 0]
    # p(1) / q(1) = 2: kept for any u (u / q would be 2 > p)
    assert sampled_outcome(half, [1], np.array([[0.5, 0.25, 0.25]]), T1, 1,
                           0).tolist() == [1, 2]


def test_rows_past_the_block_change_no_device_decision():
    """Rows past the block (a forward's other rows) change no decision."""
    rng = np.random.default_rng(4)
    base = rng.normal(size=(3, 6)).astype(np.float32)
    padded = mx.array(np.concatenate([base, rng.normal(size=(5, 6)).astype(np.float32)]))
    q = np.full((2, 6), 1 / 6)
    for seed in range(6):
        for qq in (None, q):
            assert (sampled_outcome(mx.array(base), [1, 4], qq, T1, seed, 2).tolist()
                    == sampled_outcome(padded, [1, 4], qq, T1, seed, 2).tolist())
        tree = ([0, 1, 4], [-1, 0, 1], [0, 1, 2])
        assert (sampled_tree_outcome(mx.array(base), *tree, T1, seed, 2).tolist()
                == sampled_tree_outcome(padded, *tree, T1, seed, 2).tolist())


def test_device_tree_draws_are_keyed_by_depth_like_plain_steps():
    """A chain-shaped tree of the tokens plain steps would draw commits exactly those tokens
    (node at depth t draws with position start + t's key), and then the plain step's draw."""
    rng = np.random.default_rng(0)
    rows = mx.array(rng.normal(size=(4, 50)).astype(np.float32))
    plain = [sampled_outcome(rows[i : i + 1], (), None, T1, 77, start=5 + i).tolist()[1]
             for i in range(4)]
    tree = sampled_tree_outcome(rows, [9, *plain[:3]], [-1, 0, 1, 2], [0, 1, 2, 3], T1, 77, 5)
    assert tree.tolist() == [3, plain[3]]


def test_device_tree_of_a_root_alone_and_of_one_draft():
    V = 5

    def rows(*want):
        x = np.full((len(want), V), -60.0, dtype=np.float32)
        x[np.arange(len(want)), want] = 0.0
        return mx.array(x)

    assert sampled_tree_outcome(rows(3), [9], [-1], [0], T1, 1, 0).tolist() == [0, 3]
    one = ([9, 1], [-1, 0], [0, 1])
    assert sampled_tree_outcome(rows(1, 4), *one, T1, 1, 0).tolist() == [1, 4]
    assert sampled_tree_outcome(rows(2, 4), *one, T1, 1, 0).tolist() == [0, 2]
