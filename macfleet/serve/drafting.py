"""Every decoding session's draft for the next iteration: how long (`lengths`: the
controller's wish, cut to what pays at this batch's measured costs and to the room the
iteration has), then the drafts themselves (`draft_all`), a new `BlockDraft` per block written
only here. A request's prediction drafts beside the session's own drafters, leaving them as
they would be without it. docs/serving.md, "drafting.py".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from macfleet.engine.controller import AUTO, DraftTokens
from macfleet.engine.constraint import constrained_draft, constrained_tree
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import make_proposer
from macfleet.engine.proposers.base import (EMPTY_DRAFT, Draft, Proposer, ProposerFailed,
                                            sanitize_draft)
from macfleet.engine.text import Drafting, no_drafts, plan_drafting
from macfleet.engine.tree import TokenTree
from macfleet.engine.proposers.group import (ProposerGroup, cap_total, make_group,
                                             tree_of_drafts)
from macfleet.serve.batch_session import BatchSession, BlockDraft
from macfleet.serve.costs import BatchCosts
from macfleet.serve.scheduler import DraftView, IterationBudget, draft_acceptance, plan_drafts

log = logging.getLogger(__name__)

PROBE_EVERY = 16  # sessions try one draft at least this often, whatever the estimates say
PROBE_GROUPS = 4  # ... in this many groups, spread over those iterations

Chains = Callable[[Sequence[tuple[Proposer, Sequence[int], int]], Callable[[], float]],
                  list[Draft]]


def make_drafting(spec: str, lm: LoadedModel, draft_tokens: DraftTokens,
                  invariant: bool) -> Drafting:
    """A new session's drafter from an engine's proposer spec: a chain drafter, a group
    (several drafters joined by '+', or one that drafts trees), or None; `auto`: a group
    that chooses its drafter per block (engine/choosing.py), one chooser per session."""
    if spec == AUTO:
        from macfleet.engine.choosing import auto_spec, make_auto_group

        spec = auto_spec(lm)
    drafting: Drafting = make_auto_group(lm, draft_tokens) if spec == AUTO else plan_drafting(
        spec, chain=lambda one: make_proposer(one, lm),
        tree=lambda specs: make_group([make_proposer(x, lm) or no_drafts(x) for x in specs],
                                      draft_tokens))
    if drafting is not None:
        try:
            check_drafting(drafting, invariant)
        except ValueError:
            drafting.close()
            raise
    return drafting


def check_drafting(drafting: Proposer | ProposerGroup, invariant: bool) -> None:
    """Refuse what the batch-invariant mode cannot run: drafters fed the verifier's hidden
    states (the flat batch's rows feed them; each session there runs its own forward)."""
    members = drafting.proposers if isinstance(drafting, ProposerGroup) else [drafting]
    if invariant and any(p.wants_features for p in members):
        raise ValueError(f"'{drafting.name}' drafts from hidden states; the batch-invariant "
                         "mode runs each session's own forward (token drafters only)")


def rows_of(p: Proposer | None):
    """The store a local chain drafter's cache is a row of (drafted together), or None."""
    return p.rows if p is not None else None


def within(ks: dict[int, int], adaptive: Sequence[int], room: int | None) -> dict[int, int]:
    """The adaptive sessions' lengths (sids `adaptive`) cut, largest first, to the room the
    fixed ones leave (None: no limit)."""
    if room is None:
        return ks
    planned = set(adaptive)
    left = room - sum(k for sid, k in ks.items() if sid not in planned)
    return {**ks, **dict(zip(adaptive, cap_total([ks[sid] for sid in adaptive], left)))}


class BatchDrafting:
    """chains: drafts local chains together (`draft_together`; passed in so a caller can
    count or replace it)."""

    def __init__(self, vocab: int, clock: Callable[[], float], costs: BatchCosts,
                 chains: Chains) -> None:
        self.vocab, self.clock, self.costs, self._chains = vocab, clock, costs, chains

    def lengths(self, decoding: list[BatchSession], budget: IterationBudget, *,
                iteration: int) -> tuple[dict[int, int], frozenset[int]]:
        """Each decoding session's draft length, and the sessions planned: adaptive lengths
        cut by `plan_drafts` to what pays, then to the budget's `drafts`; the others keep
        their fixed length, so their drafts (and a seeded sample) do not depend on the batch."""
        room = budget.drafts
        wants = {s.sid: min(s.group.node_budget if s.group is not None else s.controller.next_k(),
                            s.left)
                 for s in decoding}
        # in a batch the planned drafts cap a tree's nodes; alone, its drafters size it
        # (results/serve-trees/serve.json)
        adaptive = [s for s in decoding if wants[s.sid] > 0 and (
            (s.auto_tree and len(decoding) > 1)
            or (s.proposer is not None and getattr(s.controller, "alpha", None) is not None))]
        cost = self.costs.batch_cost()
        planned_sids = frozenset(s.sid for s in adaptive)
        mine = [s.sid for s in adaptive]
        if not adaptive:
            return wants, planned_sids
        if cost is None:
            return within(wants, mine, room), planned_sids
        pool_n, pool_acc = self.costs.pool_totals()
        # sessions probe in PROBE_GROUPS groups, each group together once in PROBE_EVERY
        # iterations (docs/serving.md, "drafting.py")
        phase = iteration % PROBE_EVERY
        step = PROBE_EVERY // PROBE_GROUPS
        views = [DraftView(s.sid, draft_acceptance(s.stats.hits, s.stats.trials, pool_acc,
                                                   pool_n),
                           wants[s.sid], getattr(s.controller, "draft_ms", None) or 0.0,
                           probe=phase == (s.sid % PROBE_GROUPS) * step,
                           together=rows_of(s.proposer) is not None)
                 for s in adaptive]
        fixed = sum(1 + wants[s.sid] for s in decoding if s not in adaptive)
        planned = plan_drafts(views, lambda n: cost(n + fixed), self.costs.step_ms or 0.0,
                              stall_ratio=budget.stall_ratio)
        return within({**wants, **planned}, mine, room), planned_sids

    def draft_all(self, decoding: list[BatchSession], ks: dict[int, int]) -> None:
        """Every decoding session's draft: all requests go out (`begin`) before any reply is
        collected (`finish`), so the batch waits for the slowest drafter, not the sum."""
        t0 = self.clock()
        asked, groups, together = [], {}, {}
        for s in decoding:
            s.block = b = BlockDraft(ks[s.sid])
            rows = rows_of(s.proposer) if b.k > 0 else None
            if rows is not None:
                together.setdefault(id(rows), []).append(s)
            elif s.group is not None:
                if ks[s.sid] == 0 and s.group.plain_ahead:  # (its step went out ahead)
                    s.group.plain_block()
                    groups[s.sid] = [0] * len(s.group.proposers)
                else:
                    groups[s.sid] = cap_total(s.group.lengths(s.left, s.context), ks[s.sid])
                b.k = sum(groups[s.sid])
                s.group.begin(s.context, groups[s.sid])
            elif s.proposer is not None and b.k > 0:
                try:
                    s.proposer.begin(s.context, b.k)
                    asked.append(s)
                except ProposerFailed as e:
                    self._lose_proposer(s, e)
        for sessions in together.values():  # local chains of one model: all at once
            drafts = self._chains([(s.proposer, s.context, s.block.k) for s in sessions],
                                  self.clock)
            # one draft position past the first (which also runs what was committed since)
            step = next((d.step_ms for d in drafts if d.step_ms is not None), None)
            if step is not None:
                self.costs.observe_step(step)
            for s, d in zip(sessions, drafts):
                s.block.draft = sanitize_draft(d, s.block.k, self.vocab)
                s.block.draft_ms = d.draft_ms
        drafted = {s.sid for ss in together.values() for s in ss}
        for s in decoding:
            if s.sid in drafted:
                continue
            b = s.block
            if s.group is not None:
                b.drafts, b.tree = tree_of_drafts(s.context[-1], s.group.finish(),
                                                  groups[s.sid], self.vocab,
                                                  s.req.params.greedy)
            elif s in asked:
                try:
                    d = sanitize_draft(s.proposer.finish(), b.k, self.vocab)
                    b.draft = d if d.parents is None else EMPTY_DRAFT
                except ProposerFailed as e:
                    self._lose_proposer(s, e)
            b.draft_ms = (self.clock() - t0) * 1e3
        for s in decoding:  # a request's prediction, beside what the others drafted
            if s.prediction is not None:
                self._predict(s)
        for s in decoding:  # structured output: forced tokens first, drafts cut to the grammar
            if s.constraint is None:
                continue
            b = s.block
            if b.tree is not None:  # a tree keeps its shape: each node cut on its own path
                b.tree = constrained_tree(s.constraint, b.tree, s.left)
            else:
                b.draft = Draft(constrained_draft(s.constraint, b.draft.tokens, s.left), None,
                                b.draft_ms)

    def _predict(self, s: BatchSession) -> None:
        """The prediction's draft (up to what the answer has room for) joined to the block:
        the block untouched when it drafts nothing."""
        if s.left <= 0:
            return
        d = sanitize_draft(s.prediction.propose(s.context, min(s.prediction.draft_length(),
                                                               s.left)), s.left, self.vocab)
        if not d.tokens:
            return
        b = s.block
        drafts = b.drafts if b.tree is not None else [b.draft]
        b.drafts, b.tree = with_draft(s.context[-1], drafts, d, s.req.params.greedy)
        b.draft, b.predicted = EMPTY_DRAFT, True

    @staticmethod
    def _lose_proposer(s: BatchSession, e: ProposerFailed) -> None:
        log.warning("session %d: proposer failed (%s), continuing without", s.sid, e)
        s.proposer.close()
        s.proposer = None


def close_drafters(s: BatchSession) -> None:
    """An ended session's drafters closed (each once)."""
    for d in (s.proposer, s.group, s.prediction):
        if d is not None:
            d.close()
    s.proposer = s.group = s.prediction = None


def with_draft(root: int, drafts: Sequence[Draft], d: Draft, greedy: bool
               ) -> tuple[list[Draft], TokenTree]:
    """A block's drafts (sanitized: a chain's one, or a tree's) with `d` last, merged into
    their token tree under `root` (`tree_of_drafts`'s; nodes they share are each one's)."""
    drafts = [*drafts, d if not greedy else Draft(d.tokens, None, d.draft_ms, d.parents)]
    return drafts, TokenTree.from_drafts(root, [x.tokens for x in drafts],
                                         [x.probs for x in drafts], [x.parents for x in drafts])
