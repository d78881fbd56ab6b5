"""Each decoding session's draft length and draft (serve/drafting.py); scripted drafters."""

from __future__ import annotations

import numpy as np
import pytest
from engine_parts_kit import Scripted, session

from macfleet.engine.proposers.base import Draft
from macfleet.engine.proposers.group import ProposerGroup
from macfleet.serve.batch_session import BlockDraft
from macfleet.serve.costs import BatchCosts
from macfleet.serve.drafting import BatchDrafting, check_drafting, within
from macfleet.serve.engine import plan_segments
from macfleet.serve.scheduler import IterationBudget

VOCAB = 50


def _drafting(chains=None) -> BatchDrafting:
    now = iter(range(1000))
    return BatchDrafting(VOCAB, lambda: float(next(now)) / 1e3,
                         BatchCosts(None, 1.5, probe=lambda m: {}),
                         chains or (lambda jobs: pytest.fail("no EAGLE chains here")))


def test_within_cuts_the_planned_lengths_largest_first_to_the_room_left():
    ks = {0: 5, 1: 2, 2: 4}  # session 2 has a fixed length: never cut
    assert within(ks, [0, 1], None) == ks
    assert within(ks, [0, 1], 7) == {0: 1, 1: 2, 2: 4}  # 3 left: 5 is cut to 2, then 1


def test_the_invariant_mode_refuses_feature_drafters_alone():
    class Fed(Scripted):
        wants_features = True

    check_drafting(Scripted(), invariant=True)
    check_drafting(ProposerGroup([Scripted(), Scripted()]), invariant=True)  # trees: its own
    for fed in (Fed(), ProposerGroup([Scripted(), Fed()])):
        with pytest.raises(ValueError, match="batch-invariant"):
            check_drafting(fed, invariant=True)
        check_drafting(fed, invariant=False)


def test_fixed_lengths_are_kept_and_cut_only_by_what_is_left_to_generate():
    d = _drafting()
    a = session(0, proposer=Scripted(), draft_tokens=4, max_tokens=10)
    b = session(1, proposer=Scripted(), draft_tokens=4, max_tokens=3)
    ks, planned = d.lengths([a, b], IterationBudget(256, 9, 1, 1.5), iteration=0)
    assert ks == {0: 4, 1: 2} and planned == frozenset()


def test_automatic_lengths_share_the_room_of_the_iteration():
    d = _drafting()
    ss = [session(i, proposer=Scripted(), draft_tokens="auto", max_tokens=50)
          for i in range(2)]
    free, _ = d.lengths(ss, IterationBudget(256, 256, None, 1.5), iteration=0)
    ks, planned = d.lengths(ss, IterationBudget(256, 9, 3, 1.5), iteration=0)
    assert planned == frozenset({0, 1}) and min(free.values()) >= 2
    assert sum(ks.values()) == 3


def test_drafts_are_asked_sanitized_and_a_failed_drafter_is_dropped():
    d = _drafting()
    good = session(0, proposer=Scripted([(7, 8, 99, 9)]))  # 99 is out of the vocabulary
    tree = session(1, proposer=Scripted())
    tree.proposer.propose = lambda ctx, k: Draft((1, 2), parents=(-1, -1))
    dead = session(2, proposer=Scripted(fail=True))
    idle = session(3, proposer=Scripted([(1,)]))
    d.draft_all([good, tree, dead, idle], {0: 3, 1: 2, 2: 2, 3: 0})
    assert good.block.draft.tokens == (7, 8) and good.proposer.seen == [3]
    assert tree.block.draft.tokens == ()  # a chain drafter's tree is not verified as a chain
    assert dead.proposer is None and dead.block.draft.tokens == ()
    assert idle.proposer.seen == [] and idle.block.draft.tokens == ()
    assert all(s.block.draft_ms > 0 for s in (good, tree, dead, idle))


def test_a_group_drafts_a_token_tree_of_its_drafters():
    d = _drafting()
    s = session(0, group=ProposerGroup([Scripted([(4, 5)]), Scripted([(4, 6)])],
                                       draft_tokens=2))
    d.draft_all([s], {0: 4})
    assert s.block.draft.tokens == () and s.block.k == 4
    assert s.block.tree.tokens == [3, 4, 5, 6] and len(s.block.drafts) == 2


def test_every_block_starts_from_no_drafts():
    """A block's drafts are its own: the last block's draft, tree or prediction never carry
    over to a block that drafts nothing."""
    d = _drafting()
    s = session(0, proposer=Scripted([(7, 8)]))
    d.draft_all([s], {0: 2})
    assert s.block.draft.tokens == (7, 8) and s.block.k == 2
    s.block.tree, s.block.predicted = "last block's tree", True
    d.draft_all([s], {0: 0})
    b = s.block
    assert (b.draft.tokens, b.k, b.tree, b.drafts, b.predicted) == ((), 0, None, [], False)


def test_the_scheduler_cuts_a_block_to_its_slot():
    """Two decoding sessions' blocks in an iteration of 5 tokens: the older keeps its whole
    block, the other's drafts (and their probabilities) are cut to the one token left."""
    a, b = (session(i, proposer=Scripted()) for i in range(2))
    for s in (a, b):
        s.kv_handle.prefilled = 2  # prompt[:-1] is in: decoding
        s.block = BlockDraft(3, Draft((4, 5, 6), np.ones((3, VOCAB))))
    run, segs = plan_segments([a, b], IterationBudget(5, 5), frozenset(), chunked=True,
                              align=0)
    assert [sl.tokens for _, sl in run] == [4, 1]
    assert segs[0].tokens == (3, 4, 5, 6) and segs[1].tokens == (3,)
    assert b.block.draft.tokens == () and len(b.block.draft.probs) == 0
