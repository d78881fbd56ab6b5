"""The block step every decode shares (engine/block.py): acceptance, stop cut, statistics."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from macfleet.engine.block import BlockTally, cut_at_stop, node_path, tree_decided, tree_decision
from macfleet.engine.proposers.base import Draft
from macfleet.engine.sampling import GREEDY, SamplingParams, probs_from_logits
from macfleet.engine.tree import TokenTree, accept_tree_sample
from macfleet.stats import GenerationStats, ProposerStats
from reference_rules import accept_chain

V = 8


def accept_tree(tree, logits, params, rng, seed, start):
    """A tree block's decision as the serving engine takes it (serve/decode.py): on the
    device (`tree_decision` / `tree_decided`), or SpecInfer's host rule when it says None."""
    out = tree_decision(tree, logits, params, seed, start)
    if out is None:
        return accept_tree_sample(tree, probs_from_logits(logits, params), rng)
    return tree_decided(tree, params, out.tolist())


def _logits(argmax: list[int]) -> mx.array:
    """[len, V] logits whose row i peaks at argmax[i]."""
    a = np.full((len(argmax), V), -5.0, np.float32)
    a[np.arange(len(argmax)), argmax] = 5.0
    return mx.array(a)


def test_greedy_chain_accepts_the_leading_matches_and_takes_the_argmax_after():
    logits = _logits([3, 4, 7, 1])
    assert accept_chain(Draft((3, 4, 5)), logits, GREEDY, 0, 0) == (2, 7)
    assert accept_chain(Draft((3, 4, 7)), logits, GREEDY, 0, 0) == (3, 1)  # bonus
    assert accept_chain(Draft(()), logits[:1], GREEDY, 0, 0) == (0, 3)  # a plain step


def test_greedy_chain_decides_on_the_given_target_not_the_logits():
    """A batch computes every greedy block's argmax in one evaluation and passes it in."""
    assert accept_chain(Draft((3, 4)), _logits([3, 4, 7]), GREEDY, 0, 0, [3, 0, 6]) == (1, 0)


def test_sampled_chain_uses_the_ratio_test_with_probabilities_and_exact_match_without():
    params = SamplingParams(1.0, 1.0, 5)
    logits = _logits([2, 2, 2])  # nearly all mass on 2
    q = np.full((2, V), 1.0 / V)
    n, nxt = accept_chain(Draft((2, 2), q), logits, params, 5, 0)
    assert (n, nxt) == (2, 2)
    n, nxt = accept_chain(Draft((5, 2)), logits, params, 5, 0)
    assert (n, nxt) == (0, 2)  # exact match: y ~ p is 2, not the draft's 5


def test_tree_acceptance_follows_the_matching_branch():
    # root, then two children of the root: 4 (node 1) and 6 (node 2); node 3 = 5 under 6
    tree = TokenTree.from_drafts(0, [(4,), (6, 5)], [None, None], [None, None])
    logits = _logits([6, 1, 5, 2])  # rows by node: root -> 6, node 2 (6) -> 5, node 3 -> 2
    path, nxt = accept_tree(tree, logits, GREEDY, None, 0, 0)
    assert tree.path_tokens(path) == [6, 5] and nxt == 2
    hot = SamplingParams(1.0, seed=2)  # sampled, no draft probabilities: decided on the device
    path, nxt = accept_tree(tree, logits * 4, hot, None, 2, 0)
    assert tree.path_tokens(path) == [6, 5] and nxt == 2


def test_cut_at_stop():
    assert cut_at_stop([1, 2, 3], frozenset({9})) == ([1, 2, 3], False)
    assert cut_at_stop([1, 9, 3], frozenset({9, 3})) == ([1], True)
    assert cut_at_stop([9], frozenset({9})) == ([], True)


def test_tally_counts_drafted_blocks_in_the_histogram_and_every_block_in_time():
    t = BlockTally()
    t.record(0, 0, 1.0, 10.0)  # a plain step: a block, no draft
    t.record(4, 2, 2.0, 20.0)
    t.record(3, 0, 3.0, 30.0)
    st = t.stats(tokens=6, elapsed_s=1.0, prefill_ms=5.0, proposer="ngram",
                 finish_reason="length")
    assert (st.blocks, st.drafted, st.accepted) == (3, 7, 2)
    assert st.accepted_hist == (1, 0, 1)  # grown to the longest accepted length, no further
    assert (st.draft_ms, st.verify_ms) == (6.0, 60.0)
    assert BlockTally(blocks=2).stats(tokens=2, elapsed_s=1.0, prefill_ms=0.0, proposer="none",
                                      finish_reason="stop").accepted_hist == ()


# -- what mutation testing of block.py found untested (issue 36) ---------------------------


def _uniform_logits(rows: int) -> mx.array:
    """[rows, V] equal logits: p = 1/V everywhere at temperature 1."""
    return mx.zeros((rows, V), dtype=mx.float32)


def test_a_sampled_chain_with_probabilities_takes_the_ratio_test_not_exact_match():
    """p(d) = 1/8 >= q(d) = 0.1: the ratio test keeps every draft on every draw, where
    exact-match sampling (y ~ p equal to d) would keep a draft one time in eight."""
    q = np.full((2, V), 0.9 / (V - 1))
    q[:, 0] = 0.1
    for seed in range(12):
        params = SamplingParams(1.0, seed=seed)
        n, nxt = accept_chain(Draft((0, 0), q), _uniform_logits(3), params, seed, 0)
        assert n == 2 and 0 <= nxt < V


def test_a_sampled_tree_with_probabilities_takes_specinfers_rule_on_the_host():
    """Candidates with q rows: SpecInfer's rule (p(x) >= q(x) keeps x on every draw), with the
    caller's generator; exact-match on the device would keep token 3 one time in eight."""
    q = np.full((1, V), 0.9 / (V - 1))
    q[0, 3] = 0.1
    tree = TokenTree.from_drafts(0, [(3,)], [q])
    hot = SamplingParams(1.0, seed=1)
    for seed in range(12):
        path, nxt = accept_tree(tree, _uniform_logits(2), hot, np.random.default_rng(seed),
                                seed, 0)
        assert tree.path_tokens(path) == [3] and 0 <= nxt < V


def test_node_path_is_the_chain_below_the_root():
    tree = TokenTree.from_drafts(0, [(4,), (6, 5)], [None, None], [None, None])
    assert node_path(tree, 0) == []
    assert node_path(tree, 1) == [1]
    assert node_path(tree, 3) == [2, 3]
    hot = SamplingParams(1.0, seed=2)  # the device walk ends at node 1: its path is [1]
    path, nxt = accept_tree(tree, _logits([4, 7, 1, 2]) * 4, hot, None, 2, 0)
    assert path == [1] and nxt == 7


def test_tally_histogram_grows_by_exactly_what_a_longer_block_needs_and_counts_repeats():
    t = BlockTally()
    t.record(2, 0, 0.0, 0.0)
    t.record(2, 1, 0.0, 0.0)  # accepted == len(hist): grows by one
    t.record(2, 1, 0.0, 0.0)  # the same length again: counted, not overwritten
    assert t.hist == [1, 2]
    t.record(5, 4, 0.0, 0.0)  # from two entries to five, no further
    assert t.hist == [1, 2, 0, 0, 1]
    assert (t.blocks, t.drafted, t.accepted) == (4, 11, 6)


def test_tally_stats_carry_every_field_given():
    t = BlockTally()
    t.record(3, 2, 1.5, 7.0)
    per = (ProposerStats("ngram", 3, 2),)
    st = t.stats(tokens=3, elapsed_s=0.25, prefill_ms=4.0, proposer="ngram",
                 finish_reason="stop", per_proposer=per)
    assert st == GenerationStats(tokens=3, elapsed_s=0.25, prefill_ms=4.0, blocks=1,
                                 drafted=3, accepted=2, draft_ms=1.5, verify_ms=7.0,
                                 proposer="ngram", finish_reason="stop", accepted_hist=(0, 0, 1),
                                 per_proposer=per)
