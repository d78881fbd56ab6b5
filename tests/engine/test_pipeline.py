"""The loop keeps the device busy without changing what it commits (engine/pipeline.py and the
pipelined parts of engine/loop.py): device-side greedy acceptance, plain steps started on the
previous step's lazy token, host drafters drafting the next block during verification, and
blocks padded to the lengths the device likes.

Token ids: the "greedy margin" rule of tests/tolerance.py against mlx-lm's plain decoding; the
pipelined loop against the synchronous one (the same verifier with `pipelines` off): the same
blocks in the same shapes, so the same ids and the same cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_testkit import finished, mlx_lm_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_loops as loop

import reference_loops as tree_loop
from macfleet.engine.acceptance import accept_greedy
from macfleet.engine.controller import make_controller
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from reference_loops import speculative_generate
from macfleet.engine.pipeline import (greedy_outcome, gumbel_pick, next_token,
                                      padded_length, rejection_rows, sampled_outcome,
                                      sampled_tree_outcome)
from macfleet.engine.proposers import Draft, Proposer
from macfleet.engine.proposers.ngram import NgramProposer
from macfleet.engine.tree import reroot
from macfleet.engine.ahead import Ahead
from macfleet.engine.proposers.group import ProposerGroup
from reference_loops import _take_ahead, tree_generate
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.verifier import SynchronousVerifier, Verifier

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
N = 40


@pytest.fixture(autouse=True)
def on_an_accelerator_path(monkeypatch):
    """Drafting ahead and padding are on by default only off the CPU: here they are forced on,
    so these tests exercise them on any machine."""
    monkeypatch.setenv("MACFLEET_DRAFT_AHEAD", "1")
    monkeypatch.setenv("MACFLEET_PAD_BLOCKS", "1")


@pytest.fixture(scope="module")
def ref(tiny) -> list[int]:
    return mlx_lm_greedy(tiny.model, PROMPT, N)


class HostOracle(Proposer):
    """A host-side drafter that knows the verifier's answer: `right` correct tokens, then a
    wrong one (None: all correct). Records the context length of every call."""

    name = "host-oracle"
    host_side = True

    def __init__(self, truth, vocab, right=None):
        self.truth, self.vocab, self.right = list(truth), vocab, right
        self.lengths: list[int] = []

    def propose(self, context, k):
        self.lengths.append(len(context))
        pos = len(context) - len(PROMPT)
        good = self.truth[pos : pos + k]
        if self.right is not None and len(good) > self.right:
            wrong = (good[self.right] + 1) % self.vocab
            good = good[: self.right] + [wrong] * (k - self.right)
        return Draft(tuple(good[:k]))


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


def test_next_token_is_the_last_rows_argmax_in_any_dtype():
    x = mx.array(np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32))
    want = int(np.array(x[-1]).argmax())
    assert next_token(x).tolist() == [want]
    assert next_token(x.astype(mx.bfloat16)).tolist() == [int(np.array(
        x[-1].astype(mx.bfloat16).astype(mx.float32)).argmax())]


def test_padded_length_takes_the_cheapest_length_that_holds_the_block():
    costs = {1: 4.0, 2: 5.0, 4: 9.6, 8: 9.4, 12: 12.0, 16: 11.4}  # MLX CUDA's shape
    assert padded_length(1, costs) == 1
    assert padded_length(2, costs) == 2
    assert padded_length(3, costs) == 8  # 4 costs more than 8
    assert padded_length(5, costs) == 8
    assert padded_length(9, costs) == 16  # 12 costs more than 16
    assert padded_length(17, costs) == 17  # beyond the table: itself
    assert padded_length(3, None) == 3 and padded_length(3, {}) == 3
    assert padded_length(3, {4: 1.0, 8: 1.0}) == 4  # a tie: the shorter


# -- plain steps, pipelined -----------------------------------------------------------------


def test_plain_pipelined_equals_mlx_lm_and_the_synchronous_loop(tiny, ref):
    fast = Verifier(tiny.model)
    assert fast.pipelines and not SynchronousVerifier(tiny.model).pipelines
    fin = finished(speculative_generate(fast, None, PROMPT, max_tokens=N))
    assert list(fin.token_ids) == ref
    slow = SynchronousVerifier(tiny.model)
    fin_s = finished(speculative_generate(slow, None, PROMPT, max_tokens=N))
    assert fin_s.token_ids == fin.token_ids
    assert fast.offset == slow.offset == len(PROMPT) + N - 1  # no step left past the end


def test_a_plain_step_is_in_flight_at_yields_and_none_after_the_end(tiny, ref):
    v = Verifier(tiny.model)
    committed, ahead = 0, 0
    for ev in speculative_generate(v, None, PROMPT, max_tokens=N):
        if isinstance(ev, TokensCommitted):
            committed += len(ev.tokens)
        elif isinstance(ev, BlockDone):
            extra = v.offset - (len(PROMPT) + committed - 1)
            assert extra in (0, 1)  # the next step started on this one's token
            ahead += extra
    assert ahead == N - 1  # every step but the last started before the previous was read
    assert v.offset == len(PROMPT) + N - 1


def test_sampled_plain_steps_are_pipelined_and_equal_the_synchronous_loop(tiny):
    """Sampling pipelines like greedy: the token is drawn on the device (keyed by position),
    the next step starts on it before it is read, and the synchronous loop draws the same."""
    hot = SamplingParams(1.3, top_p=0.9, seed=21)
    v = Verifier(tiny.model)
    committed, ahead = 0, 0
    for ev in speculative_generate(v, None, PROMPT, params=hot, max_tokens=N):
        if isinstance(ev, TokensCommitted):
            committed += len(ev.tokens)
        elif isinstance(ev, BlockDone):
            ahead += v.offset - (len(PROMPT) + committed - 1)
    assert ahead == N - 1 and v.offset == len(PROMPT) + N - 1
    runs = [finished(speculative_generate(w, None, PROMPT, params=hot, max_tokens=N)).token_ids
            for w in (Verifier(tiny.model), SynchronousVerifier(tiny.model))]
    assert runs[0] == runs[1]
    other = finished(speculative_generate(Verifier(tiny.model), None, PROMPT, max_tokens=N,
                                          params=SamplingParams(1.3, top_p=0.9, seed=22)))
    assert other.token_ids != runs[0]


@pytest.mark.parametrize("stop", [0, 1, 7])
def test_eos_with_a_step_in_flight(tiny, ref, stop):
    """A step started past an end-of-sequence token leaves nothing: the same ids and the same
    cache as the synchronous loop."""
    eos = frozenset({ref[stop]})
    want = ref[: ref.index(ref[stop])]
    runs = []
    for v in (Verifier(tiny.model), SynchronousVerifier(tiny.model)):
        fin = finished(speculative_generate(v, None, PROMPT, max_tokens=N, eos_ids=eos))
        runs.append((list(fin.token_ids), fin.stats.finish_reason, v.offset))
    assert runs[0] == runs[1]
    assert runs[0][:2] == (want, "stop")


def test_plain_steps_between_drafted_blocks(tiny, ref):
    """An adaptive controller backing off to plain steps and probing again: pipelined plain
    runs between drafted blocks commit the same ids."""
    bad = HostOracle(ref, tiny.vocab_size, right=0)  # every draft wrong: backs off to k = 0
    fin = finished(speculative_generate(Verifier(tiny.model), bad, PROMPT, max_tokens=N,
                                        controller=make_controller("auto")))
    assert list(fin.token_ids) == ref
    assert fin.stats.drafted > 0 and fin.stats.blocks > N // 2


# -- drafting the next block while this one is verified -----------------------------------


def test_a_host_drafter_drafts_ahead_and_hits(tiny, ref):
    o = HostOracle(ref, tiny.vocab_size)
    fin = finished(speculative_generate(Verifier(tiny.model), o, PROMPT, max_tokens=N,
                                        controller=make_controller(4)))
    assert list(fin.token_ids) == ref
    assert fin.stats.accepted == fin.stats.drafted > 0
    # one fresh draft at the start; every later block was drafted ahead, past 4 drafts + the
    # guessed bonus that the committed context had not reached yet
    assert o.lengths[0] == len(PROMPT)
    assert len(o.lengths) == fin.stats.blocks
    assert all(a > b for a, b in zip(o.lengths[1:], o.lengths))


@pytest.mark.parametrize("right", [0, 1, 3])
def test_a_wrong_guess_costs_a_fresh_draft_not_a_token(tiny, ref, right):
    o = HostOracle(ref, tiny.vocab_size, right=right)
    events = list(speculative_generate(Verifier(tiny.model), o, PROMPT, max_tokens=N,
                                       controller=make_controller(4)))
    assert list(finished(events).token_ids) == ref
    full = [b for b in events if isinstance(b, BlockDone) and b.drafted == 4]
    assert full and all(b.accepted == right for b in full)
    # a pre-draft per block that missed, then a fresh draft from the committed context
    assert len(o.lengths) >= 2 * len(full)


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


# -- blocks at the lengths the device likes -------------------------------------------------


def test_blocks_are_padded_on_an_accelerator_only_unless_asked(monkeypatch):
    from macfleet.engine import pipeline

    monkeypatch.setenv(pipeline.PAD_ENV, "1")
    assert pipeline.pads_blocks()
    monkeypatch.setenv(pipeline.PAD_ENV, "0")
    assert not pipeline.pads_blocks()
    monkeypatch.delenv(pipeline.PAD_ENV)
    assert pipeline.pads_blocks() == (mx.default_device() != mx.cpu)
    monkeypatch.delenv(pipeline.AHEAD_ENV)
    assert pipeline.drafts_ahead() == (mx.default_device() != mx.cpu)
    monkeypatch.setenv(pipeline.AHEAD_ENV, "0")
    assert not pipeline.drafts_ahead()
    monkeypatch.setenv(pipeline.AHEAD_ENV, "1")  # honoured on a CPU too
    assert pipeline.drafts_ahead()


def test_padded_blocks_commit_the_same_and_leave_no_padding(tiny, ref, monkeypatch):
    costs = {1: 1.0, 2: 3.0, 8: 2.0, 16: 9.0}  # every block of 2..8 tokens runs at 8
    monkeypatch.setattr(loop, "verify_costs", lambda model: costs)
    for v in (Verifier(tiny.model), SynchronousVerifier(tiny.model)):
        committed = 0
        o = HostOracle(ref, tiny.vocab_size, right=2)
        for ev in speculative_generate(v, o, PROMPT, max_tokens=N,
                                       controller=make_controller(4)):
            if isinstance(ev, TokensCommitted):
                committed += len(ev.tokens)
            if isinstance(ev, BlockDone):
                assert v.offset == len(PROMPT) + committed - 1
            if isinstance(ev, Finished):
                assert list(ev.token_ids) == ref


# -- trees: drafted ahead along the longest path, padded ---------------------------------


def test_reroot_keeps_the_subtree_under_the_guessed_token():
    #        -1: 5 (0) -> 6 (1) -> 7 (2)
    #        -1: 8 (3) -> 9 (4);  0 -> 10 (5)
    toks, par = (5, 6, 7, 8, 9, 10), (-1, 0, 1, -1, 3, 0)
    assert reroot(toks, par, 5) == ([6, 7, 10], [-1, 0, -1], [1, 2, 5])
    assert reroot(toks, par, 8) == ([9], [-1], [4])
    assert reroot(toks, par, 6) == ([], [], [])  # 6 is no top-level guess
    assert reroot((4, 5, 6), None, 4) == ([5, 6], [-1, 0], [1, 2])  # a chain stays a chain
    assert reroot((4, 5, 6), None, 3) == ([], [], [])


class HostTreeOracle(Proposer):
    """A host-side tree drafter: its first branch is the verifier's answer (`right` tokens of
    it, then wrong ones), a second branch of the same depth is wrong from its first token."""

    name = "host-tree-oracle"
    host_side = True
    drafts_trees = True

    def __init__(self, truth, vocab, right=None):
        self.truth, self.vocab, self.right = list(truth), vocab, right
        self.lengths: list[int] = []

    def propose(self, context, k):
        self.lengths.append(len(context))
        pos = len(context) - len(PROMPT)
        depth = max(1, min(4, k // 2))
        good = self.truth[pos : pos + depth]
        if self.right is not None and len(good) > self.right:
            good = good[: self.right] + [(t + 1) % self.vocab for t in good[self.right :]]
        bad = [(t + 2) % self.vocab for t in good]
        toks = [*good, *bad]
        par = [*range(-1, len(good) - 1), -1, *range(len(good), len(good) + len(bad) - 1)]
        return Draft(tuple(toks), parents=tuple(par))


@pytest.mark.parametrize("right", [None, 0, 2])
def test_trees_drafted_ahead_commit_the_verifiers_ids(tiny, ref, right):
    o = HostTreeOracle(ref, tiny.vocab_size, right)
    group = ProposerGroup([o], draft_tokens=8, node_budget=8)
    fin = finished(tree_generate(Verifier(tiny.model), group, PROMPT, max_tokens=N))
    assert list(fin.token_ids) == ref
    if right is None:  # every block's longest path accepted and its bonus guessed: the
        # drafts made ahead (depth 4 from one token early) keep 3 under the bonus
        assert fin.stats.accepted >= 3 * (fin.stats.blocks - 1)
        assert len(o.lengths) == fin.stats.blocks  # one draft a block: all but the first ahead
    else:  # every draft made ahead missed: a fresh one too
        assert len(o.lengths) > fin.stats.blocks + fin.stats.blocks // 2


def test_a_tree_drafted_ahead_on_a_path_that_was_not_accepted_is_dropped(tiny, ref):
    """The same length, other tokens: the check compares the path, not only its length."""
    ahead = [Ahead(context_len=5, branch=(1, 2), draft=Draft((9, 3), parents=(-1, 0)))]
    assert _take_ahead(ahead, [0, 0, 1, 2, 9])[0].tokens == (3,)
    assert _take_ahead(ahead, [0, 0, 1, 7, 9]) is None
    assert _take_ahead(ahead, [0, 0, 1, 2, 8]) is None  # the bonus was not its guess


def test_padded_trees_commit_the_same(tiny, ref, monkeypatch):
    monkeypatch.setattr(tree_loop, "verify_costs", lambda model: {1: 1.0, 16: 0.5, 32: 2.0})
    o = HostTreeOracle(ref, tiny.vocab_size, 1)
    group = ProposerGroup([o], draft_tokens=8, node_budget=8)
    v = Verifier(tiny.model)
    committed = 0
    for ev in tree_generate(v, group, PROMPT, max_tokens=N):
        if isinstance(ev, TokensCommitted):
            committed += len(ev.tokens)
        if isinstance(ev, BlockDone):
            assert v.offset == len(PROMPT) + committed - 1  # no padding left behind
        if isinstance(ev, Finished):
            assert list(ev.token_ids) == ref


# -- the device-side rules, piece by piece (mutation testing of pipeline.py, issue 36) -------

T1 = SamplingParams(1.0)


def _log(p) -> mx.array:
    """Logits whose softmax at temperature 1 is p (a zero stays a zero: exp(-1e9) is 0)."""
    p = np.asarray(p, dtype=np.float64)
    return mx.array(np.where(p > 0, np.log(np.maximum(p, 1e-300)), -1e9).astype(np.float32))


def test_forced_reads_exactly_0_and_1(monkeypatch):
    from macfleet.engine import pipeline

    for env in (pipeline.PAD_ENV, pipeline.AHEAD_ENV):
        for value, want in (("1", True), ("0", False), ("yes", None), ("", None)):
            monkeypatch.setenv(env, value)
            assert pipeline._forced(env) is want, (env, value)
        monkeypatch.delenv(env)
        assert pipeline._forced(env) is None


def test_padded_length_of_nothing_and_of_one_token():
    assert padded_length(0, {1: 2.0, 4: 1.0}) == 0  # no block: nothing to pad
    assert padded_length(1, {1: 5.0, 2: 3.0}) == 2  # even one token goes where it is cheaper


def test_every_outcome_is_int32():
    """The outcome's next token feeds the next step's forward as a token id (loop.py)."""
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


def test_padding_rows_change_no_device_decision():
    """Blocks are verified at padded lengths (padded_length): rows past the block are noise."""
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
