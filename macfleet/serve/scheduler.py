"""Iteration-level scheduling (ORCA-style) and the plans priced by measured costs, as pure
functions: which sessions run and with how many tokens (decoding sessions first, never
starved; prefill chunks in what is left), how long prefill chunks and drafts may make an
iteration, which new sessions copy a prompt prefix. The rules: docs/serving.md,
"scheduler.py".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from macfleet.engine.prefix import common_prefix

DEFAULT_TOKEN_BUDGET = 256


@dataclass(frozen=True)
class SessionView:
    sid: int
    prefill_left: int  # prompt tokens still to feed (0: decoding)
    prefill_done: int = 0  # prompt tokens already in the cache
    want: int = 1  # decoding: 1 + drafts it would like verified


@dataclass(frozen=True)
class Slot:
    sid: int
    tokens: int  # decoding: block length (1 + drafts); prefill: chunk length
    prefill: bool


def plan_iteration(sessions: Sequence[SessionView], budget: int = DEFAULT_TOKEN_BUDGET, *,
                   chunked: bool = True, align: int = 0) -> tuple[Slot, ...]:
    """The slots of the next forward, decoding sessions first (in the order given)."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    decoding = [s for s in sessions if s.prefill_left <= 0]
    prefilling = [s for s in sessions if s.prefill_left > 0]
    slots: list[Slot] = []
    # every decoding session gets at least one token; drafts share what is left, oldest first
    spare = budget - len(decoding)
    for s in decoding:
        extra = max(0, min(s.want - 1, spare))
        spare -= extra
        slots.append(Slot(s.sid, 1 + extra, False))
    left = budget - sum(s.tokens for s in slots)
    if chunked and not align and len(prefilling) > 1 and left > 0:
        return tuple(slots) + share_prefill(prefilling, left)
    for s in prefilling:
        n = s.prefill_left
        if align:
            n = min(n, align - s.prefill_done % align)
        if chunked and align:
            if n > left and any(sl.prefill for sl in slots):
                break  # one aligned chunk per iteration may overrun the budget, not two
        elif chunked:
            n = min(n, left)
        if n <= 0:
            break
        slots.append(Slot(s.sid, n, True))
        left -= n
        if left <= 0:
            break
    return tuple(slots)


def share_prefill(prefilling: Sequence[SessionView], left: int) -> tuple[Slot, ...]:
    """`left` prompt tokens among several prefilling sessions: the oldest at least half, the
    rest shortest prompt first, the leftover back to the oldest (docs/serving.md,
    "scheduler.py")."""
    first, rest = prefilling[0], sorted(prefilling[1:], key=lambda s: s.prefill_left)
    give = {first.sid: min(first.prefill_left, (left + 1) // 2)}
    spare = left - give[first.sid]
    for s in rest:
        n = min(s.prefill_left, spare)
        if n <= 0:
            break
        give[s.sid] = n
        spare -= n
    give[first.sid] = min(first.prefill_left, give[first.sid] + spare)
    return tuple(Slot(s.sid, give[s.sid], True) for s in prefilling if give.get(s.sid, 0) > 0)


@dataclass(frozen=True)
class AheadView:
    """An active session as the step-ahead decision sees it, while its iteration computes.
    decoding: this iteration verifies its block of one token; drafts: it has a drafter or a
    prediction; grammar: its next row's mask depends on this iteration's token; left: tokens
    it may generate past this iteration's (`BatchSession.left`)."""

    sid: int
    decoding: bool
    drafts: bool = False
    grammar: bool = False
    left: int = 1
    cancelled: bool = False


def steps_ahead(sessions: Sequence[AheadView], *, waiting: int = 0, room: int = 0
                ) -> tuple[int, ...]:
    """The sessions whose next step may be dispatched before this iteration is read, () for
    none (docs/serving.md, "scheduler.py"): every active session must be a plain step, and
    no `waiting` request may be kept out (`room`: free session slots)."""
    if not sessions or any(not v.decoding or v.drafts or v.grammar for v in sessions):
        return ()
    going = tuple(v.sid for v in sessions if v.left > 0 and not v.cancelled)
    if waiting and room + len(sessions) - len(going) > 0:
        return ()
    return going


@dataclass(frozen=True)
class IterationBudget:
    """One iteration's limits, decided once (`iteration_budget`), read by the drafting plan
    and the scheduler. cap: the engine's token budget; tokens: the stall control's budget
    while prompts wait beside decoding sessions, else the cap; drafts: the adaptive drafts'
    share of it (None: no limit but the cap); stall_ratio: the drafting plan's bound."""

    cap: int
    tokens: int
    drafts: int | None = None
    stall_ratio: float = 0.0

    def with_fixed_drafts(self, fixed: int) -> int:
        """The scheduler's budget once the fixed-length drafts (`fixed` tokens) are known."""
        return self.tokens if self.drafts is None else min(self.cap, self.tokens + fixed)


def iteration_budget(cap: int, decoding: int, prefill_left: int, stall_tokens: int | None,
                     stall_ratio: float) -> IterationBudget:
    """The next iteration's limits. stall_tokens: the stall control's budget when prompts wait
    beside `decoding` sessions, None when the iteration is not stall-controlled."""
    if stall_tokens is None:
        return IterationBudget(cap, cap, None, stall_ratio)
    return IterationBudget(cap, stall_tokens, draft_room(stall_tokens, decoding, prefill_left),
                           stall_ratio)


def draft_room(budget: int, decoding: int, prefill_left: int) -> int:
    """The draft tokens the stall control's `budget` leaves the decoding sessions once the
    prompts (`prefill_left` tokens) have theirs: one allowance, prompts first, so the two do
    not compound (docs/serving.md, "scheduler.py")."""
    return max(0, budget - decoding - prefill_left)


DEFAULT_STALL_RATIO = 1.5
MIN_PREFILL_CHUNK = 8
STALL_EMA = 0.2
MAX_CHUNK_GROWTH = 1.5


MAX_CURVE_CHUNK = 256  # the longest chunk a cost curve is searched for
MIN_FIT, MAX_FIT = 0.5, 4.0  # how far measured chunk iterations may scale the curve


class CostCurve(Protocol):
    """A forward's cost by its tokens (engine/tree_budget.VerifyCurve)."""

    @property
    def samples(self) -> bool: ...

    def cost(self, length: int) -> float: ...


@dataclass
class StallControl:
    """Sizes prefill chunks so an iteration costs at most `ratio` x a decode-only one: by the
    machine's verify(L) `curve` when known (scaled by `fit`, how far measured chunk
    iterations missed it), else by the measurements alone; never below `min_chunk`
    (docs/serving.md, "scheduler.py")."""

    ratio: float = DEFAULT_STALL_RATIO
    min_chunk: int = MIN_PREFILL_CHUNK
    decode_ms: float | None = None  # EMA of iterations without prefill
    chunk: int = MIN_PREFILL_CHUNK
    curve: CostCurve | None = None
    fit: float = 1.0  # EMA of measured / curve-predicted time of chunk iterations
    scale: float | None = None  # EMA of decode-only iterations' measured / curve-priced time

    def observe(self, prefill_tokens: int, decode_tokens: int, ms: float) -> None:
        curve = self.curve if self.curve is not None and self.curve.samples else None
        if prefill_tokens == 0:
            if decode_tokens and ms > 0:
                self.decode_ms = ema(self.decode_ms, ms)
                if curve is not None:  # the curve's scale on this batch, at its own lengths
                    self.scale = ema(self.scale, ms / curve.cost(decode_tokens))
            return
        if self.decode_ms is None or decode_tokens == 0 or ms <= 0:
            return
        growth = min(MAX_CHUNK_GROWTH, self.ratio * self.decode_ms / ms)
        self.chunk = max(self.min_chunk, int(prefill_tokens * growth))
        if curve is not None and self.scale is not None:
            # measured against the curve at this iteration's own length: decode-only
            # iterations carry drafts, so their mean is no yardstick for a chunk's
            err = ms / (self.scale * curve.cost(decode_tokens + prefill_tokens))
            self.fit = min(MAX_FIT, max(MIN_FIT, ema(self.fit, err)))

    def budget(self, decode_tokens: int, token_budget: int, waiting: int = 1,
               decoding: int = 1) -> int:
        """The next iteration's token budget. When more sessions wait to prefill than decode
        (a burst), the stall allowed grows by waiting / decoding: the longer iteration serves
        more first tokens than it delays next ones."""
        if self.ratio <= 0 or decode_tokens == 0:
            return token_budget  # nobody would wait for the prefill
        scale = max(1.0, waiting / max(decoding, 1))
        chunk = int(self.chunk * scale)
        if self.curve is not None and self.curve.samples:
            chunk = max(self.min_chunk, curve_chunk(self.curve, decode_tokens,
                                                    self.ratio * scale / self.fit,
                                                    token_budget - decode_tokens))
        return max(1, min(token_budget, decode_tokens + chunk))


def ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - STALL_EMA) * old + STALL_EMA * new


def curve_chunk(curve: CostCurve, decode_tokens: int, ratio: float, room: int) -> int:
    """The largest chunk c <= room whose iteration (decode_tokens + c) the curve prices within
    ratio x the decode-only one (0: none does)."""
    limit = ratio * curve.cost(decode_tokens)
    best = 0
    for c in range(1, min(room, MAX_CURVE_CHUNK) + 1):
        if curve.cost(decode_tokens + c) <= limit:
            best = c
    return best


MIN_SHARED_PREFIX = 8


@dataclass(frozen=True)
class PrefixView:
    """A session as prefix sharing sees it: the tokens whose keys/values its cache holds now
    and the prompt tokens it will hold once prefilled (prompt[:-1])."""

    sid: int
    cached: tuple[int, ...]
    target: tuple[int, ...]


@dataclass(frozen=True)
class PrefixCopy:
    dst: int
    src: int
    tokens: int


def plan_prefix_sharing(sessions: Sequence[PrefixView], min_shared: int = MIN_SHARED_PREFIX
                        ) -> tuple[tuple[PrefixCopy, ...], frozenset[int]]:
    """Which new sessions copy a prompt prefix from another session's cache, and which wait
    for a session ahead of them that is prefilling at least `min_shared` more of it (the
    first never waits). docs/serving.md, "scheduler.py"."""
    copies: list[PrefixCopy] = []
    waiting: set[int] = set()
    for i, s in enumerate(sessions):
        if s.cached or len(s.target) < min_shared:
            continue
        n, src = max(((common_prefix(s.target, o.cached), o.sid) for o in sessions
                      if o.sid != s.sid and o.cached), default=(0, -1))
        ahead = max((common_prefix(s.target, o.target) for o in sessions[:i]
                     if o.sid not in waiting and len(o.cached) < len(o.target)), default=0)
        if ahead >= n + min_shared:
            waiting.add(s.sid)
        elif n >= min_shared:
            copies.append(PrefixCopy(s.sid, src, n))
    return tuple(copies), frozenset(waiting)


@dataclass(frozen=True)
class DraftView:
    """A decoding session as batch draft planning sees it."""

    sid: int
    alpha: float  # measured per-token acceptance of its drafts
    want: int  # drafts its own controller asks for
    draft_ms: float = 0.0  # drafting cost per token (on the engine thread, before the forward)
    probe: bool = False  # gets one draft whatever it costs, so a low estimate can recover
    together: bool = False  # drafted with the others in one call: costs step_ms per position


PLAN_MARGIN = 1.02  # more drafts must promise this much more than the best plan so far


def plan_drafts(sessions: Sequence[DraftView], cost: Callable[[int], float],
                step_ms: float = 0.0, stall_ratio: float = 0.0) -> dict[int, int]:
    """How many drafts each decoding session gets this iteration: the best-first prefix of
    every session's drafts with the most expected tokens per ms at `cost(tokens)`, within
    `stall_ratio` x the iteration without drafts (docs/serving.md, "scheduler.py")."""
    ks = {s.sid: min(1, s.want) if s.probe else 0 for s in sessions}
    if not sessions:
        return ks

    def ms() -> float:
        n = sum(ks.values())
        own = sum(s.draft_ms * ks[s.sid] for s in sessions if not s.together)
        steps = max((ks[s.sid] for s in sessions if s.together), default=0)
        return cost(len(sessions) + n) + own + step_ms * steps

    def rate(value: float) -> float:
        return value / max(ms(), 1e-6)

    limit = (stall_ratio * cost(len(sessions)) if stall_ratio > 0 and len(sessions) > 1
             else float("inf"))

    value = len(sessions) + sum(s.alpha for s in sessions if ks[s.sid])
    best, plan = rate(value), dict(ks)
    wanted = sum(s.want for s in sessions)
    row_ms = (cost(len(sessions) + wanted) - cost(len(sessions))) / max(wanted, 1)
    items = sorted(((s.alpha ** j, j, s.sid,
                     s.alpha ** j / max(row_ms + (0.0 if s.together else s.draft_ms), 1e-6))
                    for s in sessions for j in range(1, s.want + 1)),
                   key=lambda it: (-it[3], it[1]))
    for v, j, sid, _ in items:
        if v <= 0 or ks[sid] != j - 1:  # a session's drafts are taken in order
            continue
        ks[sid] = j
        value += v
        r = rate(value)
        if r > best * PLAN_MARGIN and ms() <= limit:
            best, plan = r, dict(ks)
    return plan


POOL_WEIGHT = 4.0


def draft_acceptance(accepted: int, trials: int, pool_accepted: int, pool_trials: int) -> float:
    """A session's per-token acceptance: its own geometric trials (n accepted of k drafts: n
    successes in n + (n < k) trials) shrunk towards every session's recent pool, which
    starts from 1/2 (Laplace)."""
    pool = (pool_accepted + 1.0) / (pool_trials + 2.0)
    return (accepted + POOL_WEIGHT * pool) / (trials + POOL_WEIGHT)


COST_WINDOW = 48


@dataclass
class IterationCost:
    """Milliseconds of an iteration as a + b * tokens, least squares over the recent ones; b
    stays while their token counts do not spread enough to fit a slope."""

    window: int = COST_WINDOW
    samples: list[tuple[int, float]] = field(default_factory=list)
    a: float | None = None
    b: float | None = None

    def observe(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or ms <= 0:
            return
        self.samples.append((tokens, ms))
        del self.samples[:-self.window]
        n = len(self.samples)
        mx_ = sum(t for t, _ in self.samples) / n
        my = sum(m for _, m in self.samples) / n
        var = sum((t - mx_) ** 2 for t, _ in self.samples)
        if var >= n * 0.25:  # token counts spread by at least ~half a token
            cov = sum((t - mx_) * (m - my) for t, m in self.samples)
            self.b = max(0.0, cov / var)
        if self.b is not None:
            self.a = max(0.0, my - self.b * mx_)

    def predict(self, tokens: int) -> float | None:
        if self.a is None or self.b is None:
            return None
        return self.a + self.b * tokens
