"""A group of proposers drafting for one sequence: their drafts merged into one token tree
verified in one forward, each with its own draft length (docs/drafters.md, "group.py")."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from macfleet.engine.controller import AdaptiveDraftLength, DraftTokens, FixedDraftLength
from macfleet.engine.proposers.base import (EMPTY_DRAFT, Draft, Proposer, ProposerFailed,
                                            sanitize_draft)
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.tree import TokenTree
from macfleet.stats import ProposerStats

log = logging.getLogger(__name__)

DEFAULT_NODE_BUDGET = 16
DEFAULT_K_MAX = 8

TREE_DRAFTER_BUDGET = 24  # nodes a dynamic-tree drafter may use (it picks its own size)


def cap_total(ks: Sequence[int], total: int) -> list[int]:
    """Draft lengths cut (largest first) until they sum to at most `total`."""
    ks = list(ks)
    while sum(ks) > max(total, 0):
        ks[ks.index(max(ks))] -= 1
    return ks


def tree_of_drafts(root: int, drafts: Sequence[Draft], ks: Sequence[int], vocab: int,
                   greedy: bool) -> tuple[list[Draft], TokenTree]:
    """A block's drafts, sanitized (and without draft probabilities when greedy: acceptance
    does not read them), merged into its token tree under `root`."""
    drafts = [sanitize_draft(d, k, vocab) for d, k in zip(drafts, ks)]
    if greedy:
        drafts = [Draft(d.tokens, None, d.draft_ms, d.parents) for d in drafts]
    return drafts, TokenTree.from_drafts(root, [d.tokens for d in drafts],
                                         [d.probs for d in drafts], [d.parents for d in drafts])


def tree_budget(proposers: Sequence[Proposer]) -> int:
    """The node budget of a group: room for a dynamic tree when one of them drafts trees."""
    return max([DEFAULT_NODE_BUDGET, *(TREE_DRAFTER_BUDGET for p in proposers if p.drafts_trees)])


class ProposerGroup:
    """Proposers drafting for one sequence: every request begun before any is collected."""

    choice = None  # a group that chooses its drafter per block (engine/choosing.py): this one's
    choices: Sequence = ()
    trace: Sequence = ()  # ... and what it saw (stats.BlockTrace)
    plain_ahead = False  # its next block may decode plainly unchosen (ChoosingGroup's)

    def __init__(self, proposers: Sequence[Proposer], *, draft_tokens: int | str = "auto",
                 k_max: int = DEFAULT_K_MAX, node_budget: int = DEFAULT_NODE_BUDGET) -> None:
        if not proposers:
            raise ValueError("a proposer group needs at least one proposer")
        self.proposers = list(proposers)
        self.node_budget = node_budget
        self.controllers = [AdaptiveDraftLength(k_max=k_max) if draft_tokens == "auto"
                            else FixedDraftLength(int(draft_tokens)) for _ in proposers]
        self.live = [True] * len(proposers)
        self.drafted = [0] * len(proposers)
        self.accepted = [0] * len(proposers)

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.proposers)

    def start(self, params: SamplingParams) -> None:
        for p in self.proposers:
            p.start(params)

    def lengths(self, limit: int, context: Sequence[int] | None = None) -> list[int]:
        """Draft length per proposer, a tree drafter's the node budget, shared with the others.
        context: the block's (read by `ChoosingGroup`)."""
        ks = [0 if not live else min(self.node_budget if p.drafts_trees else c.next_k(), limit)
              for p, c, live in zip(self.proposers, self.controllers, self.live)]
        return cap_total(ks, self.node_budget)

    def begin(self, context: Sequence[int], ks: Sequence[int]) -> None:
        """Every proposer's request (`Proposer.begin`); `finish` collects them."""
        self._begun: list[int] = []
        for j, (p, k) in enumerate(zip(self.proposers, ks)):
            if k > 0 and self.live[j]:
                try:
                    p.begin(context, k)
                    self._begun.append(j)
                except ProposerFailed as e:
                    self._fail(j, e)

    def finish(self) -> list[Draft]:
        """Each proposer's draft (EMPTY_DRAFT where k is 0 or it failed: pruned)."""
        out = [EMPTY_DRAFT] * len(self.proposers)
        for j in self._begun:
            try:
                out[j] = self.proposers[j].finish()
            except ProposerFailed as e:
                self._fail(j, e)
        self._begun = []
        return out

    def _fail(self, j: int, e: Exception) -> None:
        log.warning("proposer %s failed (%s): pruned from the tree", self.proposers[j].name, e)
        self.live[j] = False

    def seed_verify_costs(self, costs) -> None:
        for p in self.proposers:
            p.seed_verify_costs(costs)

    def observe(self, drafts: Sequence[Draft], accepted: Sequence[int], verify_ms: float,
                verified: int | None = None) -> None:
        for j, (p, c, d, n) in enumerate(zip(self.proposers, self.controllers, drafts,
                                              accepted)):
            c.observe(len(d), n, d.draft_ms, verify_ms)
            p.observe(len(d), n, verify_ms, verified)
            self.drafted[j] += len(d)
            self.accepted[j] += n

    def close(self) -> None:
        for p in self.proposers:
            p.close()

    def drafter_stats(self) -> tuple:
        """Each candidate's blocks, when the group chooses its drafter per block."""
        return ()

    def per_proposer(self) -> tuple[ProposerStats, ...]:
        return tuple(ProposerStats(p.name, d, a)
                     for p, d, a in zip(self.proposers, self.drafted, self.accepted))


def make_group(proposers: Sequence[Proposer], draft_tokens: DraftTokens) -> ProposerGroup:
    """A tree of drafters with the node budget a tree drafter among them needs."""
    return ProposerGroup(proposers, draft_tokens=draft_tokens, node_budget=tree_budget(proposers))
