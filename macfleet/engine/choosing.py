"""`--proposer auto`: a group of drafters of which the chooser (engine/chooser.py) picks, block
by block, the candidate that drafts (issue 44).

`ChoosingGroup` is a `ProposerGroup`, so the tree loop runs it unchanged; only the chosen
candidate's drafters draft and learn. The free candidates also draft when not chosen and are
scored against the text committed after them. Why: docs/engine.md, "Choosing the drafter".
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from macfleet.engine.chooser import PLAIN, Candidate, Chooser, Prior, tree_depth, tree_match
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer, ProposerFailed
from macfleet.engine.proposers.group import ProposerGroup, cap_total, tree_budget
from macfleet.engine.tree_budget import TreeSizing
from macfleet.stats import EXPLORE, BlockTrace, DrafterChoice, DrafterStats

AUTO_NAME = "auto"
SHADOW_K = 4  # a free chain drafter's draft scored from the text (trees: the node budget)
FREE_K_MAX = 16  # ... and what it drafts when chosen, doubling from SHADOW_K (free_chain_k)
MAX_PENDING = 8  # a free candidate's drafts waiting for the text to score them
AHEAD_RUN = 3  # plain blocks in a row that go out ahead of the chooser before it chooses again
# (more while below the floor with nothing to try or proven: `Chooser.stays_plain`)


class ChainsOf(Proposer):
    """The chains of an EAGLE-2 tree proposer's head, sharing its cache and verifier tap."""

    def __init__(self, tree, name: str = "eagle") -> None:
        self.tree = tree
        self.name = name

    def propose(self, context: Sequence[int], k: int) -> Draft:
        from macfleet.engine.proposers.eagle.chain import EagleProposer

        return EagleProposer.propose(self.tree, context, k)


def free_chain_k(k: int, drafted: int, accepted: int) -> int:
    """Pure: what a chosen free chain drafter drafts next, after one of `k` asked, `drafted`
    drafted and `accepted` accepted: twice k (at most FREE_K_MAX) when the block was full (a
    copy running on), else SHADOW_K."""
    return min(2 * k, FREE_K_MAX) if drafted >= k > 0 and accepted >= drafted else SHADOW_K


@dataclass(frozen=True)
class _Shadow:
    """A free candidate's draft of one block, waiting for the text to score it."""

    start: int  # context length when drafted
    drafts: tuple[Draft, ...]
    verified: int  # tokens its block would have verified (drafts + 1)
    draft_ms: float


class ChoosingGroup(ProposerGroup):
    """A group of drafters of which one candidate drafts each block (`choice`, per session)."""

    def __init__(self, proposers: Sequence[Proposer], candidates: Sequence[Candidate], *,
                 draft_tokens: int | str = "auto", prior: Mapping[str, Prior] | None = None
                 ) -> None:
        super().__init__(proposers, draft_tokens=draft_tokens,
                         node_budget=tree_budget(proposers))
        self.candidates = tuple(candidates)
        self.prior = dict(prior or {})
        self._greedy = True
        # a tree drafter's index -> the candidates that are chains of its head (ChainsOf)
        self._chains = {j: tuple(c.name for c in self.candidates if len(c.members) == 1
                                 and getattr(proposers[c.members[0]], "tree", None) is p)
                        for j, p in enumerate(proposers) if p.drafts_trees}
        self._reset()

    def _reset(self) -> None:
        self.chooser = Chooser(self.candidates, prior=self.prior)
        self.choice: DrafterChoice | None = None
        self.choices: list[DrafterChoice] = []
        self._tally = {c.name: [0, 0, 0] for c in self.candidates}
        self._pending: dict[str, list[_Shadow]] = {c.name: [] for c in self.candidates}
        self._draft_ms = 0.0
        self._free_k: dict[int, int] = {}  # a chosen free chain drafter's next k, by index
        self._ks: list[int] = []
        # free drafts made before the choice: (context length, k), draft, ms by drafter
        self._early: dict[int, tuple[tuple[int, int], Draft, float]] = {}
        self._ahead_run = 0  # plain blocks since the chooser last chose (`plain_block`)
        self._ahead: bool | None = None  # `plain_ahead` of this block, once asked
        self._made: dict[int, tuple[tuple[int, int], Draft, float]] = {}  # ... taken as drafted
        self._expected: float | None = None  # the block's, by its drafter (`finish`)

    @property
    def name(self) -> str:
        return AUTO_NAME

    def start(self, params) -> None:
        super().start(params)
        self._greedy = params.temperature == 0
        self._reset()

    def seed_verify_costs(self, costs) -> None:
        super().seed_verify_costs(costs)
        self.chooser.curve.seed(costs)

    def _members(self) -> tuple[int, ...]:
        return self.chooser.by_name(self.choice.drafter).members if self.choice else ()

    @property
    def plain_ahead(self) -> bool:
        """Whether its next block may decode plainly without a choice, so the engine can send
        that step out before this block is read (`scheduler.steps_ahead`): this block was
        chosen plain (not a try of plain decoding), at most AHEAD_RUN blocks in a row, so a
        candidate due a try or proven by this block's text waits that many blocks at most;
        more while the chooser is held below its floor with nothing to try (`stays_plain`:
        each choice it skips would be plain decoding's, and each costs the step ahead)."""
        if self._ahead is None:  # decided once a block: the engine asks when it sends the
            # step out, and again when it drafts that block (the chooser has learnt since)
            c = self.choice
            self._ahead = (c is not None and c.drafter == PLAIN and c.why != EXPLORE
                           and (self._ahead_run < AHEAD_RUN or self.chooser.stays_plain()))
        return self._ahead

    def plain_block(self) -> None:
        """The next block decodes plainly, not chosen (its step went out ahead)."""
        self.choice = self.chooser.plain()
        self._ahead_run += 1
        self._ahead = None

    def lengths(self, limit: int, context: Sequence[int] | None = None) -> list[int]:
        """context: the block's (pending shadows are scored, and the free candidates draft
        first so the choice knows what their blocks would verify)."""
        if context is not None:
            self._score_shadows(context)
        self._ahead_run, self._ahead = 0, None
        self.choice = self.chooser.choose(None if context is None else
                                          self._sizes(context, limit))
        free = self.chooser.by_name(self.choice.drafter).free
        ks = [0] * len(self.proposers)
        for j in self._members():
            p = self.proposers[j]
            if self.live[j]:
                # a free candidate drafts what its shadows were scored on, not what its own
                # length controller says (docs/engine.md, "Choosing the drafter")
                ks[j] = min(self._free_length(j) if free or p.drafts_trees
                            else self.controllers[j].next_k(), limit)
        return cap_total(ks, self.node_budget)

    def _free_draft(self, j: int, context: Sequence[int], k: int) -> tuple[Draft, float]:
        """Free drafter j's draft of k tokens here and its ms, made once a block."""
        early = self._early.get(j)
        if early is not None and early[0] == (len(context), k):
            return early[1], early[2]
        if not self.live[j]:
            return EMPTY_DRAFT, 0.0
        t0 = time.perf_counter()
        try:
            d = self.proposers[j].propose(context, k)
        except ProposerFailed as e:
            self._fail(j, e)
            d = EMPTY_DRAFT
        self._early[j] = ((len(context), k), d, (time.perf_counter() - t0) * 1e3)
        return d, self._early[j][2]

    def _sizes(self, context: Sequence[int], limit: int) -> dict[str, int]:
        """What each free candidate's block would verify here (drafts + 1, drafts <= `limit`)."""
        self._early = {}
        out = {}
        for c in self.candidates:
            if c.free and c.members:
                n = sum(len(self._free_draft(j, context, self._free_length(j))[0])
                        for j in c.members)
                out[c.name] = 1 + min(n, self.node_budget, limit)
        return out

    def _free_length(self, j: int, shadow: bool = False) -> int:
        """What free drafter j drafts: a tree its node budget, a chain SHADOW_K (chosen:
        free_chain_k's length)."""
        if self.proposers[j].drafts_trees:
            return self.node_budget
        return SHADOW_K if shadow else self._free_k.get(j, SHADOW_K)

    def begin(self, context: Sequence[int], ks: Sequence[int]) -> None:
        """The chosen drafters' requests (then `finish`); a free drafter's draft of this block
        made before the choice (`_sizes`) at the same length is not drafted again."""
        self._score_shadows(context)
        self._t0, self._context, self._ks = time.perf_counter(), context, list(ks)
        self._made = {j: self._early[j] for j, k in enumerate(ks)
                      if k > 0 and j in self._early and self._early[j][0] == (len(context), k)}
        super().begin(context, [0 if j in self._made else k for j, k in enumerate(ks)])

    def finish(self) -> list[Draft]:
        out = super().finish()
        for j, (_, d, _) in self._made.items():
            out[j] = d
        # the drafts made before the choice cost the block their time too
        self._draft_ms = (time.perf_counter() - self._t0) * 1e3 + sum(
            ms for _, _, ms in self._made.values())
        self._shadow(self._context, self._ks, out)
        self._early = {}
        # what the chosen drafter expects its block to accept: a tree sized on it (eagle2's)
        members = self._members()
        p = self.proposers[members[0]] if len(members) == 1 else None
        self._expected = (p.predicted if isinstance(p, TreeSizing) and len(out[members[0]])
                          and not self.chooser.by_name(self.choice.drafter).free else None)
        return out

    def _score_shadows(self, context: Sequence[int]) -> None:
        """Score the free candidates' drafts whose outcome the committed text now tells: a
        mismatch seen, or more committed than the draft's deepest path."""
        for name, waiting in self._pending.items():
            for sh in list(waiting):
                committed = context[sh.start:]
                matched = max((tree_match(d.tokens, d.parents, committed) for d in sh.drafts),
                              default=0)
                depth = max((tree_depth(d.parents, len(d)) for d in sh.drafts), default=0)
                if matched < len(committed) or len(committed) > depth:
                    self.chooser.shadow(name, matched, sh.verified, sh.draft_ms)
                    waiting.remove(sh)

    def _shadow(self, context: Sequence[int], ks: Sequence[int], out: Sequence[Draft]) -> None:
        """Draft for every free candidate not chosen, to be scored when the text tells."""
        chosen = self.choice.drafter if self.choice else PLAIN
        mine: dict[int, tuple[Draft, float]] = {}
        for c in self.candidates:
            if not c.free or not c.members or c.name == chosen or \
                    len(self._pending[c.name]) >= MAX_PENDING:
                continue
            drafts, ms = [], 0.0
            for j in c.members:
                if j not in mine:
                    mine[j] = ((out[j], out[j].draft_ms) if ks[j] > 0 else
                               self._free_draft(j, context, self._free_length(j, True)))
                drafts.append(mine[j][0])
                ms += mine[j][1]
            self._pending[c.name].append(_Shadow(len(context), tuple(drafts),
                                                 1 + sum(len(d) for d in drafts), ms))

    def observe(self, drafts: Sequence[Draft], accepted: Sequence[int], verify_ms: float,
                verified: int | None = None) -> None:
        """Only the chosen drafters learn (an empty block of one not asked would trip a tree
        drafter's backoff); the chooser learns the block's cost."""
        members = self._members()
        free = self.choice is not None and self.chooser.by_name(self.choice.drafter).free
        for j in members:
            d, n = drafts[j], accepted[j]
            if free and not self.proposers[j].drafts_trees and j < len(self._ks):
                self._free_k[j] = free_chain_k(self._ks[j], len(d), n)
            self.controllers[j].observe(len(d), n, d.draft_ms, verify_ms)
            self.proposers[j].observe(len(d), n, verify_ms, verified)
            self.drafted[j] += len(d)
            self.accepted[j] += n
        if self.choice is None:
            return
        got = max((accepted[j] for j in members), default=0)
        size = verified or 1 + sum(len(drafts[j]) for j in members)
        self.chooser.observe(self.choice.drafter, got, size, self._draft_ms, verify_ms,
                             self._expected)
        self._expected = None
        if self._greedy:  # a head's tree that kept nothing: its chain's block would not either
            for j in members:
                if len(drafts[j]) and accepted[j] == 0:
                    for name in self._chains.get(j, ()):
                        self.chooser.implied(name, 0)
        t = self._tally[self.choice.drafter]
        t[0] += 1
        t[1] += self.choice.why == EXPLORE
        t[2] += got + 1
        self.choices.append(self.choice)

    @property
    def trace(self) -> list[BlockTrace]:
        """What the chooser saw, block by block (stats.BlockTrace)."""
        return self.chooser.trace

    def drafter_stats(self) -> tuple[DrafterStats, ...]:
        return tuple(DrafterStats(name, *t) for name, t in self._tally.items())


def auto_candidates(has_head: bool, has_store: bool) -> tuple[list[str], list[Candidate]]:
    """Pure: the drafters (specs; `eagle` is `ChainsOf` the `eagle2` proposer) and the
    candidates of `auto` for a model with a shipped head and/or answer store."""
    specs = ["ngram"] + (["retrieval"] if has_store else []) + \
        (["eagle2", "eagle"] if has_head else [])
    ix = {s: i for i, s in enumerate(specs)}
    cands = [Candidate(PLAIN), Candidate("ngram", (ix["ngram"],), free=True)]
    if has_store:
        cands += [Candidate("retrieval", (ix["retrieval"],), free=True),
                  Candidate("retrieval+ngram", (ix["retrieval"], ix["ngram"]), free=True)]
    if has_head:
        cands += [Candidate("eagle", (ix["eagle"],)), Candidate("eagle2", (ix["eagle2"],))]
        if has_store:
            rn = (ix["retrieval"], ix["ngram"])
            # (chains beside the lookups measured below both alone, issue 44: not a candidate)
            cands += [Candidate("eagle2+retrieval+ngram", (ix["eagle2"], *rn))]
    return specs, cands


def auto_spec(lm) -> str:
    """What `auto` drafts with for this verifier: AUTO_NAME where it has tree attention, else
    the record's winner (without it each branch is verified alone and trees cannot sample)."""
    from macfleet.engine.proposers.choice import resolve_proposer
    from macfleet.engine.tree_verify import supports_tree_attention

    if supports_tree_attention(lm.model):
        return AUTO_NAME
    return resolve_proposer(AUTO_NAME, lm.spec)[0]


def make_auto_group(lm, draft_tokens: int | str = "auto",
                    prior: Mapping[str, Prior] | None = None) -> ChoosingGroup:
    """`auto` for this verifier: every drafter it has here; prior: the offline record's
    figures by candidate (default: this machine's or the shipped bench record)."""
    from macfleet.engine.proposers.choice import auto_prior
    from macfleet.engine.proposers.factory import ProposerSpecError, make_proposer
    from macfleet.engine.proposers.shipped import default_head_path, default_store_path

    def build(spec: str) -> Proposer | None:
        try:
            return make_proposer(spec, lm)
        except ProposerSpecError:
            return None

    head = default_head_path(lm.spec)
    store = default_store_path(lm.spec)
    tree = build("eagle2") if head is not None and head.is_file() else None
    ret = build("retrieval") if store is not None else None
    specs, cands = auto_candidates(tree is not None, ret is not None)
    made = {"ngram": build("ngram"), "retrieval": ret, "eagle2": tree,
            "eagle": ChainsOf(tree) if tree is not None else None}
    return ChoosingGroup([made[s] for s in specs], cands, draft_tokens=draft_tokens,
                         prior=auto_prior(lm.spec) if prior is None else prior)
