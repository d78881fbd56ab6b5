"""The N-proposers loop (engine/tree_loop.py) part by part: the group's lengths, requests,
pruning and tallies with scripted drafters (no model), drafts made ahead, and the loop's
sampled and fallback paths against plain decoding with the same seed. Written for the mutants
of tree_loop.py that the end-to-end tests (test_tree.py, test_pipeline.py) let survive
(issue 36, docs/testing.md)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_testkit import finished, mlx_lm_greedy

import reference_loops as tree_loop
from macfleet.engine.controller import AdaptiveDraftLength, FixedDraftLength
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from reference_loops import speculative_generate
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer, ProposerFailed
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.tree import TokenTree
from macfleet.engine.ahead import Ahead
from macfleet.engine.proposers import group as proposer_group
from macfleet.engine.proposers.group import ProposerGroup, tree_budget, tree_of_drafts
from reference_loops import _predraft, _take_ahead, tree_generate
from macfleet.engine.verifier import Verifier
from macfleet.stats import ProposerStats

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
N = 40


class Said(Proposer):
    """Drafts what it is told (or fails); records what it was asked and told."""

    def __init__(self, name: str, drafts=(), *, fail: bool = False, trees: bool = False,
                 host: bool = False, fail_begin: bool = False) -> None:
        self.name, self.drafts, self.fail, self.fail_begin = name, list(drafts), fail, fail_begin
        self.drafts_trees, self.host_side = trees, host
        self.asked: list[tuple[int, int]] = []  # (context length, k) of each request
        self.observed: list[tuple] = []
        self.started = self.costs = None
        self.closed = False

    def start(self, params) -> None:
        self.started = params

    def begin(self, context, k) -> None:
        if self.fail_begin:
            raise ProposerFailed("unreachable")
        super().begin(context, k)

    def propose(self, context, k) -> Draft:
        if self.fail:
            raise ProposerFailed("gone")
        self.asked.append((len(context), k))
        return Draft(tuple(self.drafts.pop(0)) if self.drafts else (), draft_ms=1.5)

    def observe(self, drafted, accepted, verify_ms, verified=None) -> None:
        self.observed.append((drafted, accepted, verify_ms, verified))

    def seed_verify_costs(self, costs) -> None:
        self.costs = costs

    def close(self) -> None:
        self.closed = True


def test_a_group_sizes_asks_prunes_and_tallies_its_drafters():
    a, t, d = Said("a", [(4, 5, 6)]), Said("t", [(7,)], trees=True), Said("d", fail=True)
    g = ProposerGroup([a, t, d], draft_tokens=3, node_budget=7)
    assert g.name == "a+t+d"
    assert all(isinstance(c, FixedDraftLength) and c.k == 3 for c in g.controllers)
    g.start(GREEDY)
    g.seed_verify_costs({1: 2.0})
    assert a.started is GREEDY and d.started is GREEDY and t.costs == {1: 2.0}
    # a tree drafter asks for the node budget; the total is cut to it, largest first
    assert g.lengths(10) == [2, 2, 3]
    assert g.lengths(1) == [1, 1, 1]  # what is left to generate caps each
    out = g.draft_all([1, 2], [2, 2, 3])
    assert [o.tokens for o in out] == [(4, 5, 6), (7,), ()] and out[2] is EMPTY_DRAFT
    assert a.asked == [(2, 2)] and t.asked == [(2, 2)]
    assert g.live == [True, True, False]  # the failed drafter is pruned...
    assert g.lengths(10) == [3, 4, 0]  # ... and gets no length
    # a non-empty draft made ahead stands for its drafter's; an empty one does not
    got = g.draft_all([1, 2, 3], [2, 2, 0], [Draft((9,)), None, Draft((8,))])
    assert [o.tokens for o in got] == [(9,), (), ()]
    assert a.asked == [(2, 2)] and t.asked == [(2, 2), (3, 2)]
    g.draft_all([1], [1, 0, 1], [Draft(()), None, None])
    assert a.asked == [(2, 2), (1, 1)] and t.asked == [(2, 2), (3, 2)]  # k 0: not asked
    g.observe([Draft((4, 5, 6), draft_ms=1.0), Draft((7,)), EMPTY_DRAFT], [2, 1, 0], 5.0, 9)
    g.observe([Draft((4,)), EMPTY_DRAFT, EMPTY_DRAFT], [0, 0, 0], 4.0, 2)
    assert a.observed == [(3, 2, 5.0, 9), (1, 0, 4.0, 2)] and t.observed[0] == (1, 1, 5.0, 9)
    assert g.per_proposer() == (ProposerStats("a", 4, 2), ProposerStats("t", 1, 1),
                                ProposerStats("d", 0, 0))
    g.close()
    assert a.closed and t.closed and d.closed
    with pytest.raises(ValueError):
        ProposerGroup([])
    # a drafter whose request cannot even be sent is pruned too, and not collected
    e, f = Said("e", fail_begin=True), Said("f", [(3,)])
    g = ProposerGroup([e, f], draft_tokens=2)
    assert [o.tokens for o in g.draft_all([1], [2, 2])] == [(), (3,)]
    assert g.live == [False, True] and e.asked == []


class Rec:
    """A draft-length controller that records what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def next_k(self) -> int:
        return 2

    def observe(self, k, accepted, draft_ms, verify_ms) -> None:
        self.seen.append((k, accepted, draft_ms, verify_ms))


def test_adaptive_lengths_and_the_group_node_budget():
    g = ProposerGroup([Said("a"), Said("b")], k_max=5)
    assert all(isinstance(c, AdaptiveDraftLength) and c.k_max == 5 for c in g.controllers)
    assert g.node_budget == proposer_group.DEFAULT_NODE_BUDGET == 16
    assert tree_budget([Said("a")]) == 16 and tree_budget([Said("a"), Said("t", trees=True)]) == 24
    g.controllers = [Rec(), Rec()]
    assert g.lengths(5) == [2, 2]
    g.observe([Draft((1, 2), draft_ms=4.0), EMPTY_DRAFT], [1, 0], 10.0, 3)
    assert [c.seen for c in g.controllers] == [[(2, 1, 4.0, 10.0)], [(0, 0, 0.0, 10.0)]]


def test_a_group_drafts_on_the_host_only_while_every_live_drafter_does():
    h, m = Said("h", host=True), Said("m", fail=True)
    g = ProposerGroup([h, m], draft_tokens=1)
    assert not g.host_side  # m drafts on the device
    g.draft_all([1], [1, 1])
    assert g.live == [True, False] and g.host_side  # m is gone: only h drafts
    g.live[0] = False
    assert not g.host_side  # nobody drafts


def test_tree_of_drafts_sanitizes_each_draft_and_keeps_probabilities_only_when_sampling():
    q = np.full((3, 6), 1 / 6)
    drafts = [Draft((1, 2, 5), q), Draft((1, 4, 7), parents=(-1, -1, 0)), Draft((2, 3))]
    for greedy in (True, False):
        kept, tree = tree_of_drafts(3, drafts, [2, 3, 0], 6, greedy)
        assert [d.tokens for d in kept] == [(1, 2), (1, 4), ()]  # k 2 | 7 is out of vocabulary
        assert kept[1].parents == (-1, -1)
        assert tree.tokens == [3, 1, 2, 4]
        if greedy:
            assert all(d.probs is None for d in kept)
            assert all(c.q is None for cs in tree.candidates for c in cs)
        else:
            assert kept[0].probs.shape == (2, 6)
            assert [c.q is not None for c in tree.candidates[0]] == [True, False, False]


def test_drafts_made_ahead_follow_the_longest_branch_and_reroot_with_their_rows():
    a, b, dead = Said("a", [(9, 3, 4)]), Said("b"), Said("x", fail=True)
    g = ProposerGroup([a, b, dead], draft_tokens=2)
    tree = TokenTree.from_drafts(5, [[1, 2], [6]])
    ahead = _predraft(g, [0, 0, 5], tree, [2, 0, 3])
    assert a.asked == [(5, 3)] and b.asked == []  # context + the path 1, 2; k + 1
    assert ahead[0].context_len == 6 and ahead[0].branch == (1, 2)
    assert ahead[0].draft.tokens == (9, 3, 4) and ahead[1:] == [None, None]
    assert g.live[2]  # a failure ahead is not a verdict: the fresh request reports it
    _predraft(g, [0, 0, 5], tree, [1, 0, 0])
    assert a.asked == [(5, 3), (5, 2)]  # a length of 1 is drafted ahead too
    assert _predraft(g, [0, 5], TokenTree.from_drafts(5, []), [2, 0, 0]) is None
    p = np.eye(4)[[1, 2, 3]]
    ahead = [Ahead(5, (1, 2), Draft((9, 3, 4), p, parents=(-1, 0, 1))), None,
             Ahead(5, (1, 2), Draft((9, 3), p[:2]))]
    out = _take_ahead(ahead, [0, 0, 1, 2, 9])
    assert out[0].tokens == (3, 4) and out[0].parents == (-1, 0) and out[1] is None
    assert np.array_equal(out[0].probs, p[[1, 2]]) and out[0].draft_ms == 0.0
    assert out[2].tokens == (3,) and out[2].parents is None  # a chain stays a chain
    assert _take_ahead(ahead, [0, 1, 2, 9]) is None and _take_ahead(None, [0]) is None


class TreeOracle(Proposer):
    """Drafts `truth` (the verifier's own answer: `right` tokens of it, then wrong ones) and a
    wrong sibling branch, without probabilities (exact-match acceptance)."""

    name = "oracle"
    drafts_trees = True
    host_side = True

    def __init__(self, truth, vocab, right=None) -> None:
        self.truth, self.vocab, self.right = list(truth), vocab, right

    def propose(self, context, k) -> Draft:
        pos = len(context) - len(PROMPT)
        depth = max(1, min(4, k // 2))
        good = self.truth[pos:pos + depth]
        if self.right is not None:
            good = good[:self.right] + [(t + 1) % self.vocab for t in good[self.right:]]
        bad = [(t + 2) % self.vocab for t in good]
        par = [*range(-1, len(good) - 1), -1, *range(len(good), len(good) + len(bad) - 1)]
        return Draft((*good, *bad), parents=tuple(par))


def _events(verifier, group, params=GREEDY, max_tokens=N, eos=frozenset()):
    return list(tree_generate(verifier, group, PROMPT, params=params, max_tokens=max_tokens,
                              eos_ids=eos))


@pytest.mark.parametrize("ahead", ["0", "1"])
def test_sampled_trees_of_exact_match_drafts_commit_what_plain_sampling_draws(tiny, monkeypatch,
                                                                               ahead):
    """Drafts without probabilities are accepted on the device with draws keyed by the seed
    and each token's output position: the same ids as the verifier sampling alone, padded or
    not, drafting ahead or not; the drafts were really walked."""
    monkeypatch.setenv("MACFLEET_DRAFT_AHEAD", ahead)
    monkeypatch.setenv("MACFLEET_PAD_BLOCKS", "1")
    monkeypatch.setattr(tree_loop, "verify_costs", lambda model: {1: 1.0, 16: 0.5, 32: 2.0})
    hot = SamplingParams(1.3, top_p=0.9, seed=21)
    plain = finished(speculative_generate(Verifier(tiny.model), None, PROMPT, params=hot,
                                          max_tokens=N)).token_ids
    group = ProposerGroup([TreeOracle(plain, tiny.vocab_size), TreeOracle(plain, tiny.vocab_size,
                                                                           1)], draft_tokens=6)
    made_ahead = []
    real = tree_loop._predraft
    monkeypatch.setattr(tree_loop, "_predraft", lambda *a: made_ahead.append(1) or real(*a))
    v = Verifier(tiny.model)
    fin = finished(_events(v, group, hot))
    assert fin.token_ids == plain and fin.stats.accepted >= N // 2
    assert bool(made_ahead) == (ahead == "1")  # drafted during the device's verification
    assert v.offset == len(PROMPT) + N - 1  # no padding left behind
    alone = ProposerGroup([TreeOracle(plain, tiny.vocab_size)], draft_tokens=6)
    other = finished(_events(Verifier(tiny.model), alone, SamplingParams(1.3, top_p=0.9, seed=22)))
    assert other.token_ids != plain


def test_drafts_with_probabilities_take_the_ratio_rule_seeded(tiny, monkeypatch):
    """A draft model's drafts carry probabilities: SpecInfer's rule decides on the host with
    the request's generator, so a seed fixes the output and another seed changes it."""
    from macfleet.engine.proposers import make_proposer

    rules = []
    real = tree_loop.accept_tree

    def spy(tree, logits, *a, **kw):
        rules.append(any(c.q is not None for cs in tree.candidates for c in cs))
        return real(tree, logits, *a, **kw)

    monkeypatch.setattr(tree_loop, "accept_tree", spy)

    def sample(seed):
        group = ProposerGroup([make_proposer("draft:tiny:2:64", tiny)], draft_tokens=3)
        return finished(_events(Verifier(tiny.model), group, SamplingParams(1.0, seed=seed),
                                max_tokens=20))

    a = sample(5)
    assert rules and all(rules) and a.stats.accepted > 0 and len(a.token_ids) == 20
    assert sample(5).token_ids == a.token_ids and sample(6).token_ids != a.token_ids


def test_greedy_blocks_events_and_a_reused_verifier(tiny, ref_ids):
    """Every block reports what it asked, drafted, accepted and committed; the tokens streamed
    are the answer; a verifier reused for a second request starts afresh."""
    v = Verifier(tiny.model)
    o = Said("o")
    o.propose = lambda ctx, k: Draft(tuple(
        ref_ids[len(ctx) - len(PROMPT):len(ctx) - len(PROMPT) + k]))
    for _ in range(2):
        evs = _events(v, ProposerGroup([o], draft_tokens=3))
        done = [e for e in evs if isinstance(e, BlockDone)]
        commits = [e for e in evs if isinstance(e, TokensCommitted)]
        fin = evs[-1]
        assert isinstance(fin, Finished) and list(fin.token_ids) == ref_ids
        assert [c.block for c in commits] == [d.block for d in done] == list(
            range(1, len(done) + 1))
        assert [t for c in commits for t in c.tokens] == ref_ids
        left = [N - sum(d.committed for d in done[:i]) for i in range(len(done))]
        assert [d.k for d in done] == [min(3, n - 1) for n in left]
        assert all(d.drafted == d.accepted == d.k and d.committed == d.k + 1 for d in done)
        assert all(d.block_ms >= d.verify_ms >= 0 and d.draft_ms >= 0 for d in done)
        st = fin.stats
        assert (st.tokens, st.blocks, st.finish_reason, st.proposer) == (N, len(done), "length",
                                                                          "o")
        assert st.drafted == st.accepted == sum(d.k for d in done) and st.prefill_ms > 0
        assert st.per_proposer == (ProposerStats("o", st.drafted, st.accepted),)
        # the drafter was started, told the verify costs, each block's outcome, then closed
        assert o.started == GREEDY and o.costs is not None and o.closed
        assert o.observed[-len(done):] == [(d.k, d.accepted, d.verify_ms, d.k + 1) for d in done]
        o.closed, o.started = False, None


def test_a_stop_token_ends_the_tree_loop(tiny, ref_ids):
    stop = ref_ids[7]
    want = ref_ids[:ref_ids.index(stop)]
    o = Said("o")
    o.propose = lambda ctx, k: Draft(tuple(
        ref_ids[len(ctx) - len(PROMPT):len(ctx) - len(PROMPT) + k]))
    fin = _events(Verifier(tiny.model), ProposerGroup([o], draft_tokens=4),
                  eos=frozenset({stop}))[-1]
    assert list(fin.token_ids) == want and fin.stats.finish_reason == "stop"
    assert fin.stats.tokens == len(want)
    with pytest.raises(ValueError) as e:
        list(tree_generate(Verifier(tiny.model), ProposerGroup([o]), []))
    assert str(e.value) == "empty prompt"


def test_without_tree_attention_each_branch_is_verified_and_the_cache_refilled(tiny, ref_ids,
                                                                              monkeypatch):
    """A model without llama-style attention verifies each branch on its own and refills the
    accepted entries: greedy ids unchanged; sampling is refused with a reason."""
    monkeypatch.setattr(tree_loop, "supports_tree_attention", lambda model: False)
    v = Verifier(tiny.model)
    group = ProposerGroup([TreeOracle(ref_ids, tiny.vocab_size, 2),
                           TreeOracle(ref_ids, tiny.vocab_size)], draft_tokens=6)
    fin = finished(_events(v, group))
    assert list(fin.token_ids) == ref_ids and fin.stats.accepted > N // 2
    assert v.offset == len(PROMPT) + N - 1
    with pytest.raises(ValueError) as e:
        _events(v, ProposerGroup([Said("a")]), SamplingParams(1.0, seed=1))
    assert str(e.value) == "sampling with several proposers needs tree attention (llama family)"


def test_the_kept_tree_rows_reach_a_hidden_state_drafter(tiny, ref_ids, monkeypatch):
    """Tree verification reports the hidden rows of the root and the accepted path at their
    positions: each row's own logits pick the token committed after it."""
    from macfleet.engine.layers import head_logits

    seen = []
    monkeypatch.setattr(tree_loop, "record_hidden",
                        lambda model, start, tokens, h: seen.append((model, start, tokens, h)))
    group = ProposerGroup([TreeOracle(ref_ids, tiny.vocab_size, 2),
                           TreeOracle(ref_ids, tiny.vocab_size)], draft_tokens=6)
    fin = finished(_events(Verifier(tiny.model), group))
    assert list(fin.token_ids) == ref_ids and len(seen) == fin.stats.blocks
    ctx, pos = [*PROMPT, *ref_ids], len(PROMPT) - 1
    for model, start, toks, h in seen:
        assert model is tiny.model and start == pos and list(toks) == ctx[pos:pos + len(toks)]
        picks = np.argmax(np.array(head_logits(tiny.model, h[None])[0]), axis=-1).tolist()
        assert picks == ctx[pos + 1:pos + 1 + len(toks)]
        pos += len(toks)
    assert pos == len(ctx) - 1


@pytest.fixture(scope="module")
def ref_ids(tiny) -> list[int]:
    return mlx_lm_greedy(tiny.model, PROMPT, N)


def test_a_tree_generation_is_256_tokens_unless_told(tiny):
    fin = finished(tree_generate(Verifier(tiny.model), ProposerGroup([Said("none")]), PROMPT))
    assert len(fin.token_ids) == 256 and fin.stats.finish_reason == "length"
