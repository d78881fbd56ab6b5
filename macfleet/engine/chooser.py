"""Which drafter drafts the next block, chosen while it runs (issue 44): pure decisions.

The best drafter depends on this machine's verify(L) now and on the answer being written, and
both change more than the drafters differ, so no choice fixed in advance holds. Each session
keeps, per candidate (a drafter, a tree of drafters, or plain decoding), EMAs of what its blocks
accept, verify and cost, and drafts with the one expected to commit most tokens per ms:

    rate(c) = (1 + accepted(c)) / (draft_ms(c) + verify(L(c)))

verify(L) is the machine's table (tree_budget.VerifyCurve) times its load now. How the load,
the tries, the free candidates and the offline prior are handled, and why: docs/engine.md,
"The drafter chooser".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from macfleet.engine.tree_budget import VerifyCurve
from macfleet.stats import BEST, EXPLORE, FLOOR, PRIOR, BlockTrace, DrafterChoice

PLAIN = "none"
# blocks before a losing candidate is tried again, doubling per lost try
MIN_INTERVAL = 8
MAX_INTERVAL = 128
STAGGER = 2  # untried candidates: the first at block 1, then every STAGGER blocks
EMA = 0.3
MARGIN = 1.02  # a drafter must beat plain decoding by this much to be chosen
SWITCH_MARGIN = 1.05  # ... and another drafter must beat the one drafting by this much
EXPLORE_SHARE = 0.03  # re-tries wait while the tries lost more than this share of the time
LOAD_EMA = 0.25
LOAD_CLIP = 4.0  # one block moves the load at most this factor (a stall, not a new machine)
STALL_STEPS = 2.0  # a try is charged at most this many plain steps' time
SHAPE_CLIP = 1.5  # nor its length's entry in the table more than this,
SHAPE_EMA = 0.05  # slowly: the load explains a slower machine first
TRY_WEIGHT = 1.0  # ... but a try's block sets its length's entry (clipped by LOAD_CLIP)
TRY_CLIP = 1.5  # a free candidate's try at an unmeasured length: if it pays at entry / this
PRIOR_TRIES = 2  # tries of a candidate the record says pays here that the budget never holds
FLOOR_SHARE = 0.02  # drafting may lose at most this share of the time against plain decoding
# A drafter that says what it expects a block to accept (an EAGLE-2 tree: its nodes'
# probabilities) is estimated from that, times its accepted-over-expected ratio so far, which
# starts at HEAD_GAIN counted as GAIN_PRIOR expected tokens: one block's expectation says
# half as wrong what an answer's blocks accept as the block's outcome (smollm2's shipped head
# on the bench's 18 prompts: accepted / expected 0.73, results/drafter-auto-1201).
HEAD_GAIN = 0.73
GAIN_PRIOR = 4.0


@dataclass(frozen=True)
class Candidate:
    """A drafter (or a tree of drafters, `members` indices into its group); no members: plain
    decoding. free: its drafts cost nothing to compute (scored from the text every block)."""

    name: str
    members: tuple[int, ...] = ()
    free: bool = False


@dataclass(frozen=True)
class Prior:
    """What the offline record (`bench drafter`) measured of a candidate: the winner's speedup
    over plain (0: none), accepted drafts and tokens verified per block (None: not measured)."""

    speedup: float = 0.0
    accepted: float | None = None
    verified: float | None = None


@dataclass
class _Estimate:
    accepted: float = 0.0  # per block
    length: float = 1.0  # tokens verified per block (drafts + 1)
    draft_ms: float = 0.0  # per block
    n: int = 0  # blocks measured (verified or scored from the text)
    tries: int = 0  # blocks explored
    prior: float | None = None  # speedup over plain from the offline record, until measured
    next_try: int = 0
    interval: int = MIN_INTERVAL
    started: bool = False  # accepted and length start at the record's (Prior)
    own: float = 0.0  # accepted per block, its own blocks alone (what the budget charges)
    capped: bool = False  # its first block's drafting was cut to `cap` (its second replaces it)
    hit: float | None = None  # accepted per block, over the blocks that drafted something
    won_ms: float = 0.0  # its blocks' (and shadows') time against plain decoding's
    expected: float = 0.0  # what its drafter expected its blocks to accept (`observe`)
    kept: float = 0.0  # ... and what they accepted

    def expects(self, expected: float, accepted: int) -> float:
        """A block its drafter expected `expected` of: what the estimate learns from it (the
        expectation times the drafter's accepted-over-expected ratio, HEAD_GAIN at first)."""
        self.expected += expected
        self.kept += accepted
        return expected * (self.kept + HEAD_GAIN * GAIN_PRIOR) / (self.expected + GAIN_PRIOR)

    def add(self, accepted: float, length: float, draft_ms: float,
            steady: bool = True, cap: float = float("inf")) -> None:
        """steady: it also drafted the block before (else its drafting caught up on others'
        tokens: a switching cost). cap: the most a first block's drafting counts."""
        if length > 1:
            self.hit = accepted if self.hit is None else self.hit + EMA * (accepted - self.hit)
        if self.n == 0 and not self.started:
            self.accepted, self.length = accepted, length
        else:  # (started: the record's figures count as the blocks before this one)
            self.accepted += EMA * (accepted - self.accepted)
            self.length += EMA * (length - self.length)
        if self.n == 0:
            self.capped, draft_ms = draft_ms > cap, min(draft_ms, cap)
            self.draft_ms, self.own = draft_ms, accepted
        else:
            self.own += EMA * (accepted - self.own)
            # a first block pays the drafter's warm-up: a cheaper second one replaces it
            if self.n == 1 and self.capped:
                self.draft_ms = draft_ms
            elif self.n == 1 or not steady:
                self.draft_ms = min(self.draft_ms, draft_ms)
            else:
                self.draft_ms += EMA * (draft_ms - self.draft_ms)
        self.n += 1


def tree_match(tokens: Sequence[int], parents: Sequence[int] | None,
               committed: Sequence[int]) -> int:
    """How many of a draft's tokens (a chain when parents is None) a greedy verifier accepts
    when it commits `committed` (pure): its deepest path that `committed` starts with."""
    if parents is None:
        parents = tuple(range(-1, len(tokens) - 1))
    node, depth = -1, 0
    while depth < len(committed):
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents))
                    if p == node and t == committed[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def tree_depth(parents: Sequence[int] | None, n: int) -> int:
    """The deepest path of a draft of n tokens (a chain when parents is None)."""
    if parents is None:
        return n
    depth: list[int] = []
    for p in parents[:n]:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


@dataclass
class Chooser:
    """One session's choice of drafter, block by block (pure: no clock, no model); plain
    decoding (PLAIN) is among the candidates; prior by candidate name; curve: verify(L) in ms."""

    candidates: Sequence[Candidate]
    curve: VerifyCurve = field(default_factory=VerifyCurve)
    prior: Mapping[str, Prior] = field(default_factory=dict)
    block: int = 0
    load: float = 1.0  # verify(L) now over the table's (see the module's docstring)
    spent_ms: float = 0.0  # every block's drafting and verifying
    explore_lost_ms: float = 0.0  # tries' time beyond what the best would have taken
    _est: dict[str, _Estimate] = field(default_factory=dict)
    _last: DrafterChoice | None = None
    _last_best: float = 0.0  # the best rate (tokens per ms) when _last was chosen
    _prev: str = ""  # the candidate that drafted the block before
    trace: list[BlockTrace] = field(default_factory=list)  # every observed block
    _seen: tuple[str, tuple[tuple[str, float], ...]] = ("", ())  # best and rates at choose
    _tried_lengths: set[int] = field(default_factory=set)  # lengths a try has taught
    _sizes: Mapping[str, int] = field(default_factory=dict)  # free candidates' blocks now
    _verified: set[int] = field(default_factory=set)  # lengths this session's blocks verified
    won_ms: float = 0.0  # drafted blocks' time against plain decoding's for their tokens

    def __post_init__(self) -> None:
        names = [c.name for c in self.candidates]
        if PLAIN not in names or len(set(names)) != len(names):
            raise ValueError(f"candidates need plain decoding ({PLAIN!r}) once, and unique "
                             f"names: {names}")
        untried = 0
        for c in self.candidates:
            p = self.prior.get(c.name, Prior())
            e = self._est[c.name] = _Estimate(prior=p.speedup or None)
            if p.accepted is not None and p.verified is not None and c.name != PLAIN:
                e.accepted, e.length, e.started = p.accepted, max(1.0, p.verified), True
            if c.name == PLAIN:
                e.n = 1  # known from the table, but tried too: see _follow_load
            elif not c.free and e.prior is None:
                e.next_try = 1 + STAGGER * untried
                untried += 1
            else:
                e.next_try = MIN_INTERVAL  # a prior's winner is re-measured by its own blocks
        self._est[PLAIN].next_try = 1 + STAGGER * untried  # after the untried drafters

    def by_name(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.name == name)

    def verify_ms(self, length: int) -> float:
        """verify(length) on this machine now: the table times the load."""
        return self.curve.cost(length) * self.load

    def rate(self, name: str) -> float | None:
        """Expected committed tokens per ms of the candidate's next block (None: unknown)."""
        e = self._est[name]
        plain = 1.0 / max(self.verify_ms(1), 1e-9)
        if e.n == 0:
            return None if e.prior is None else e.prior * plain
        size = self._sizes.get(name)
        if size is not None:  # a free candidate's next block, already drafted
            if size <= 1:
                return None  # nothing to draft: plain decoding's block
            return (1.0 + (e.hit or 0.0)) / max(e.draft_ms + self.verify_ms(size), 1e-9)
        cost = e.draft_ms + self.verify_ms(max(1, round(e.length)))
        return (1.0 + e.accepted) / max(cost, 1e-9)

    def _loss(self, name: str, best_rate: float) -> float:
        """ms a block of `name` is expected to take beyond what the best candidate would take
        for its tokens (0: it is expected to win), at what its own blocks accepted."""
        e = self._est[name]
        cost = e.draft_ms + self.verify_ms(max(1, round(e.length)))
        return min(max(0.0, cost - (1.0 + e.own) / max(best_rate, 1e-9)),
                   STALL_STEPS * self.verify_ms(1))

    def _unmeasured(self, c: Candidate) -> bool:
        """A free candidate whose block now has a length no block of this session verified,
        and that would beat plain decoding were that entry TRY_CLIP times too high."""
        size, e = self._sizes.get(c.name, 1), self._est[c.name]
        if size <= 1 or size in self._verified or e.n == 0:
            return False
        cost = e.draft_ms + self.verify_ms(size) / TRY_CLIP
        return (1.0 + (e.hit or 0.0)) / max(cost, 1e-9) > MARGIN / self.verify_ms(1)

    def _hopeful(self, name: str, best_rate: float) -> bool:
        """Tried fewer than PRIOR_TRIES times, and would beat `best_rate` at the record's
        acceptance (once its drafter said what its blocks expected: its estimate) and this
        machine's costs now: its re-try skips the tries' budget."""
        e, p = self._est[name], self.prior.get(name)
        if p is None or p.accepted is None or e.tries >= PRIOR_TRIES:
            return False
        cost = e.draft_ms + self.verify_ms(max(1, round(e.length)))
        # its blocks' expectations say more of this answer than the record's other answers
        accepted = e.accepted if e.expected > 0 else p.accepted
        return (1.0 + accepted) / max(cost, 1e-9) > best_rate

    def _best(self, exclude: str = "", proven: float | None = None) -> tuple[str, float]:
        """proven: only candidates that have won more than this many ms against plain."""
        best, best_rate = PLAIN, self.rate(PLAIN) or 0.0
        floor = best_rate * MARGIN
        for c in self.candidates:
            r = self.rate(c.name)
            if proven is not None and self._est[c.name].won_ms <= proven:
                continue
            if c.name not in (PLAIN, exclude) and r is not None and r > floor and r > best_rate:
                best, best_rate = c.name, r
        return best, best_rate

    def choose(self, sizes: Mapping[str, int] | None = None) -> DrafterChoice:
        """The candidate that drafts the next block, and why. sizes: the tokens the free
        candidates' blocks would verify now (their drafts + 1, drafted before the choice)."""
        self._sizes = dict(sizes or {})
        short = self._short_of_floor()
        below = short > 0
        best, best_rate = self._best(proven=short if below else None)
        top = best
        if self._prev not in ("", PLAIN, best) and self._est[self._prev].n > 0 and (
                not below or self._est[self._prev].won_ms > short):
            r = self.rate(self._prev) or 0.0  # switching costs the other's catch-up
            if r * SWITCH_MARGIN >= best_rate and r > (self.rate(PLAIN) or 0.0) * MARGIN:
                best, best_rate = self._prev, r
        due = [c for c in self.candidates if c.name != best
               and ((c.members and not c.free) or c.name == PLAIN or self._unmeasured(c))
               and self._est[c.name].next_try <= self.block
               and (self._est[c.name].n == 0 or self._est[c.name].tries == 0
                    or self._hopeful(c.name, best_rate)
                    or self.explore_lost_ms + self._loss(
                   c.name, best_rate) <= EXPLORE_SHARE * self.spent_ms)
               and (not below or self._first_or_hoped(c, best_rate))]
        if due:
            c = min(due, key=lambda c: (self._est[c.name].next_try,
                                        self.candidates.index(c)))
            ch = DrafterChoice(self.block, c.name, EXPLORE,
                               (self.rate(c.name) or 0.0) * 1e3)
        else:
            why = PRIOR if self._est[best].n == 0 else FLOOR if below and best == PLAIN \
                else BEST
            ch = DrafterChoice(self.block, best, why, best_rate * 1e3)
        # a try is charged against the best (on the prior's block: the best measured one)
        self._last, self._last_best = ch, (best_rate if ch.why != PRIOR
                                           else self._best(exclude=best)[1])
        self._seen = (top, tuple((c.name, round((self.rate(c.name) or 0.0) * 1e3, 3))
                                             for c in self.candidates))
        return ch

    def plain(self) -> DrafterChoice:
        """The next block decoded plainly without a choice (the engine sent its step out before
        the block before it was read: `ChoosingGroup.plain_ahead`); observed as any block."""
        why = self._last.why if self._last is not None else BEST
        self._last = DrafterChoice(self.block, PLAIN, why, (self.rate(PLAIN) or 0.0) * 1e3)
        return self._last

    def stays_plain(self) -> bool:
        """Whether the block after the next one is plain decoding's whatever the next one's
        text says (`ChoosingGroup.plain_ahead`: its step may go out before this block is read):
        below the floor by more than a block's share, no candidate's blocks or scored drafts
        near the shortfall, and no drafter's first or hoped-for try due by then. The one
        thing the next text can change, a free candidate proven by it, is seen a block later."""
        short = self._short_of_floor() - FLOOR_SHARE * STALL_STEPS * self.verify_ms(1)
        if short <= 0:
            return False
        plain = self.rate(PLAIN) or 0.0
        for c in self.candidates:
            e = self._est[c.name]
            if c.name == PLAIN:
                continue
            if e.won_ms > short or (e.next_try <= self.block + 1
                                    and self._first_or_hoped(c, plain)):
                return False
        return True

    def _first_or_hoped(self, c: Candidate, best_rate: float) -> bool:
        """What may draft below the floor besides a proven candidate: a drafter's first try,
        or a re-try the record hopes for (`_hopeful`)."""
        return bool(c.members) and not c.free and (
            self._est[c.name].tries == 0 or self._hopeful(c.name, best_rate))

    def _count_try(self, name: str) -> None:
        """A try of `name` seen (its own block, or one another's block told): its next waits
        twice as long if it lost against the best other candidate, else MIN_INTERVAL."""
        e = self._est[name]
        e.tries += 1
        lost = (self.rate(name) or 0.0) <= self._best_other(name)
        e.interval = min(MAX_INTERVAL, e.interval * 2) if lost else MIN_INTERVAL

    def _short_of_floor(self) -> float:
        """How many ms drafting has lost against plain decoding beyond FLOOR_SHARE of the
        session's time (> 0: below the floor). Its blocks' time against what plain steps
        would have taken for their tokens (`won_ms`) is what trusting the estimates (EMAs of
        a few blocks, a prior from other answers) has cost this answer; below the floor only
        a drafter's first try, a re-try the record hopes for (`_hopeful`), or a candidate
        whose own blocks (a free one's: its drafts scored from the text) have won more than
        the shortfall drafts, so an answer nothing pays on loses about that share."""
        return -(self.won_ms + FLOOR_SHARE * self.spent_ms)

    def observe(self, name: str, accepted: int, verified: int, draft_ms: float,
                verify_ms: float, expected: float | None = None) -> None:
        """The block `choose` picked was verified: `accepted` drafts kept of a block of
        `verified` tokens (drafts + 1), drafting took draft_ms and verifying verify_ms;
        expected: what its drafter expected it to accept (`_Estimate.expects`)."""
        last = self._last if self._last is not None and self._last.drafter == name else None
        self.trace.append(BlockTrace(
            block=self.block, drafter=name, why=last.why if last else "", best=self._seen[0],
            length=verified, accepted=accepted, draft_ms=round(draft_ms, 3),
            verify_ms=round(verify_ms, 3), table_ms=round(self.curve.cost(verified), 3),
            load=round(self.load, 4), rates=self._seen[1] if last else ()))
        # the record's winner's first block (PRIOR) is its first try, charged as one
        tried = last is not None and last.why in (EXPLORE, PRIOR)
        self._follow_load(verified, verify_ms, tried)
        self._verified.add(verified)
        self.spent_ms += draft_ms + verify_ms
        e = self._est[name]
        if name != PLAIN:
            # plain's steps for its tokens: the block's time over the table's ratio, once the
            # table learnt from it (a stall slows both alike), at most STALL_STEPS steps' loss
            step = verify_ms * self.curve.cost(1) / max(self.curve.cost(verified), 1e-9)
            won = max((1 + accepted) * step - draft_ms - verify_ms, -STALL_STEPS * step)
            self.won_ms += won
            if not (tried and e.tries == 0):  # a first try is the session's exploring,
                e.won_ms += won  # not held against the drafter
            e.add(accepted if expected is None else e.expects(expected, accepted), verified,
                  draft_ms, steady=self._prev == name, cap=self._first_draft_cap(verified))
        self._prev = name
        if tried:
            self._count_try(name)
            if self._last_best > 0:  # at most STALL_STEPS plain steps: a try that met a
                # stall (or the drafter's warm-up) would hold back every re-try
                lost = draft_ms + verify_ms - (1 + accepted) / self._last_best
                self.explore_lost_ms += min(max(0.0, lost), STALL_STEPS * self.verify_ms(1))
        e.next_try = self.block + 1 + e.interval
        self.block += 1

    def _best_other(self, name: str) -> float:
        """The best rate of a candidate other than `name` (0: none known)."""
        if name != PLAIN:
            return self._best(exclude=name)[1]
        return max((self.rate(c.name) or 0.0 for c in self.candidates if c.name != PLAIN),
                   default=0.0)

    def _follow_load(self, length: int, ms: float, tried: bool = False) -> None:
        """A verified block's time: the load moves by what the table missed (clipped), the
        table's entry for its length learns the rest (clipped tighter); a try's block teaches
        its length's entry instead, raising it only on the first try at that length."""
        if not self.curve.samples or ms <= 0:
            self.curve.observe(length, ms)
            return
        shape = self.curve.cost(length)
        if self.block == 0:  # the first block: how this machine runs now against the
            # table (probed earlier, or another day); a uniform factor moves no choice
            self.load = ms / shape
            return
        if tried:
            ms = min(shape * LOAD_CLIP, max(shape / LOAD_CLIP, ms / self.load))
            if length in self._tried_lengths:  # a try's stall is not compounded on another's
                ms = min(ms, shape)
            self._tried_lengths.add(length)
            self.curve.observe(length, ms, TRY_WEIGHT)
            return
        r = min(LOAD_CLIP, max(1 / LOAD_CLIP, ms / max(self.verify_ms(length), 1e-9)))
        self.load *= 1 + LOAD_EMA * (r - 1)
        self.curve.observe(length, min(shape * SHAPE_CLIP, max(shape / SHAPE_CLIP,
                                                               ms / self.load)), SHAPE_EMA)

    def shadow(self, name: str, accepted: int, verified: int, draft_ms: float) -> None:
        """A free candidate's draft scored from the committed text, not verified."""
        self._est[name].won_ms += ((1 + accepted) * self.verify_ms(1) - draft_ms
                                   - self.verify_ms(max(1, verified)))
        self._est[name].add(accepted, verified, draft_ms, cap=self._first_draft_cap(verified))

    def implied(self, name: str, accepted: int) -> None:
        """A block of `name` whose outcome another candidate's verified block told, at no cost
        (`ChoosingGroup`: an EAGLE chain's first token is its head's tree's best first-level
        node, so a greedy tree block that accepted nothing rejected the chain's too): a try of
        it at its measured cost. Not before its own first block (its cost is not known)."""
        e = self._est[name]
        if e.n == 0:
            return
        size = max(1, round(e.length))
        if e.tries:  # a first try is the session's exploring (as in `observe`)
            e.won_ms += (1 + accepted) * self.verify_ms(1) - e.draft_ms - self.verify_ms(size)
        e.add(accepted, size, e.draft_ms)
        self._count_try(name)
        e.next_try = max(e.next_try, self.block + e.interval)

    def _first_draft_cap(self, verified: int) -> float:
        """A first block's drafting counts at most STALL_STEPS verifies of its block."""
        return STALL_STEPS * self.verify_ms(max(1, verified))

    def measured(self, name: str) -> int:
        """Blocks measured for the candidate (verified or scored from the text)."""
        return self._est[name].n
