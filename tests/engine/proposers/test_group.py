"""A group of drafters (proposers/group.py) part by part: its lengths, requests, pruning and
tallies with scripted drafters (no model), and its tree of drafts. Written for the mutants of
the group that the end-to-end tests let survive (issue 36, docs/testing.md)."""

from __future__ import annotations

import numpy as np
import pytest

from macfleet.engine.controller import AdaptiveDraftLength, FixedDraftLength
from macfleet.engine.proposers import group as proposer_group
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer, ProposerFailed
from macfleet.engine.proposers.group import ProposerGroup, tree_budget, tree_of_drafts
from macfleet.engine.sampling import GREEDY
from macfleet.stats import ProposerStats


class Said(Proposer):
    """Drafts what it is told (or fails); records what it was asked and told."""

    def __init__(self, name: str, drafts=(), *, fail: bool = False, trees: bool = False,
                 fail_begin: bool = False) -> None:
        self.name, self.drafts, self.fail, self.fail_begin = name, list(drafts), fail, fail_begin
        self.drafts_trees = trees
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


def draft_all(g: ProposerGroup, context, ks) -> list[Draft]:
    g.begin(context, ks)
    return g.finish()


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
    out = draft_all(g, [1, 2], [2, 2, 3])
    assert [o.tokens for o in out] == [(4, 5, 6), (7,), ()] and out[2] is EMPTY_DRAFT
    assert a.asked == [(2, 2)] and t.asked == [(2, 2)]
    assert g.live == [True, True, False]  # the failed drafter is pruned...
    assert g.lengths(10) == [3, 4, 0]  # ... and gets no length
    draft_all(g, [1], [1, 0, 1])
    assert a.asked == [(2, 2), (1, 1)] and t.asked == [(2, 2)]  # k 0: not asked
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
    assert [o.tokens for o in draft_all(g, [1], [2, 2])] == [(), (3,)]
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
