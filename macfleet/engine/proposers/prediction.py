"""A request's own prediction as a drafter (OpenAI's Predicted Outputs): its continuation from
where the answer stands in it, re-aligned after an edit, as long as pays at its acceptance and
verify(L) (docs/drafters.md, "prediction.py")."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from macfleet.engine.prefix import common_prefix
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer
from macfleet.engine.tree_budget import VerifyCurve
from macfleet.stats import PREDICTION

MIN_MATCH = 2  # shortest answer suffix that re-aligns the drafter
MAX_MATCH = 8  # longest suffix tried first
LONG_MATCH = 5  # a suffix this long is trusted after misses, or behind the last position
MAX_WINDOW = 64  # bounded again by the engine's iteration budget
PRIOR_ALPHA, PRIOR_TRIALS = 0.9, 4  # a prediction is mostly right until its drafts say not
RUN_PRIOR_ALPHA = 0.97  # ... and inside a run (its last draft accepted in full), more so
RUN_MIN = 8  # tokens a draft accepted in full must hold to start a run (not a chance match)
QUIET_AFTER = 2  # consecutive drafts with nothing accepted before it waits for LONG_MATCH


def ngram_index(tokens: Sequence[int], lo: int = MIN_MATCH, hi: int = MAX_MATCH
                ) -> dict[int, dict[tuple[int, ...], list[int]]]:
    """n -> n-gram -> the positions just past each occurrence, ascending."""
    index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(lo, hi + 1)}
    for n, idx in index.items():
        for end in range(n, len(tokens) + 1):
            idx.setdefault(tuple(tokens[end - n:end]), []).append(end)
    return index


def realign(index: dict[int, dict[tuple[int, ...], list[int]]], answer: Sequence[int],
            anchor: int, long_only: bool = False) -> tuple[int, int] | None:
    """Pure: (position in the prediction after the answer's end, suffix length matched), or
    None. Longest suffix first; its first occurrence at or after `anchor` (the last aligned
    position), else, for a long suffix only, the last one before it."""
    for n in sorted(index, reverse=True):
        if len(answer) < n or (long_only and n < LONG_MATCH):
            continue
        ends = index[n].get(tuple(answer[-n:]))
        if not ends:
            continue
        i = bisect.bisect_left(ends, anchor)
        if i < len(ends):
            return ends[i], n
        if n >= LONG_MATCH:
            return ends[-1], n
    return None


@dataclass(frozen=True)
class Acceptance:
    """Per-token acceptance from a prior (PRIOR_TRIALS trials at `prior`) and `accepted` tokens in
    `trials` geometric trials (a draft's accepted tokens, plus one where it was cut short)."""

    prior: float
    accepted: int = 0
    trials: int = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)

    def seen(self, drafted: int, accepted: int) -> Acceptance:
        """Pure: with one more draft of `drafted` tokens, `accepted` of them taken."""
        return replace(self, accepted=self.accepted + accepted,
                       trials=self.trials + accepted + (accepted < drafted))


def in_run(drafted: int, accepted: int, was_in_run: bool = False) -> bool:
    """Pure: whether a draft leaves the drafter inside a run: accepted in full, and either
    continuing a run or long enough not to be a chance match."""
    return drafted > 0 and accepted == drafted and (was_in_run or accepted >= RUN_MIN)


def best_window(alpha: float, cost, max_window: int) -> int:
    """Pure: the draft length w in 0..max_window with the most committed tokens per verify
    time, (1 - a^(w+1)) / (1 - a) / cost(w + 1), at per-token acceptance `alpha`."""
    a = min(max(alpha, 0.0), 0.999)
    best, best_rate = 0, 1.0 / cost(1)
    for w in range(1, max_window + 1):
        rate = (1 - a ** (w + 1)) / (1 - a) / cost(w + 1)
        if rate > best_rate:
            best, best_rate = w, rate
    return best


class PredictionProposer(Proposer):
    """Drafts from one request's prediction (token ids)."""

    def __init__(self, prediction: Sequence[int], answer_start: int) -> None:
        if answer_start < 0:
            raise ValueError(f"answer_start must be >= 0, got {answer_start}")
        self.name = PREDICTION
        self.prediction = tuple(int(t) for t in prediction)
        self.answer_start = answer_start
        self._index = ngram_index(self.prediction)
        self.curve = VerifyCurve()
        self._price()
        self.start()

    def start(self, params=None) -> None:
        self.params = params
        self.misses = 0  # drafts in a row with nothing accepted
        self.every = Acceptance(PRIOR_ALPHA)  # every draft's
        self.on_run = Acceptance(RUN_PRIOR_ALPHA)  # the drafts that continued a run
        self._run = False  # inside a run (`in_run`)
        self._drafted_in_run = False  # the draft out now continues a run
        self._at: tuple[int, int] | None = (0, 0)  # (answer length, prediction position)
        self._anchor = 0  # the last aligned position while the drafter is not aligned
        self._sure = True  # aligned by the answer following it, or by a long match

    def seed_verify_costs(self, costs) -> None:
        self.curve.seed(dict(costs))
        self._price()

    def _price(self) -> None:
        """verify(1..MAX_WINDOW + 1) read off the curve once (it changes only when seeded)."""
        self._costs = tuple(self.curve.cost(L) for L in range(1, MAX_WINDOW + 2))
        self._prior_window = best_window(PRIOR_ALPHA, self._cost, MAX_WINDOW)

    def _cost(self, length: int) -> float:
        return self._costs[length - 1]

    @property
    def alpha(self) -> float:
        """Its per-token acceptance so far, from a prior of PRIOR_ALPHA."""
        return self.every.alpha

    def _best(self, alpha: float) -> int:
        return best_window(alpha, self._cost, MAX_WINDOW)

    @property
    def window(self) -> int:
        """The draft length that pays: inside a run at the run's acceptance; else at its
        acceptance so far, a confident alignment at the prior's length at least."""
        if self._run:
            return max(self._best(self.on_run.alpha), self._best(self.alpha))
        w = self._best(self.alpha)
        return max(w, self._prior_window) if self._sure and self.misses == 0 else w

    def draft_length(self) -> int:
        return MAX_WINDOW

    def _align(self, context: Sequence[int]) -> int | None:
        """The prediction position the answer's end stands at (None: not found), from only
        what the answer added since the last call and its last MAX_MATCH tokens."""
        at, anchor = self._at, self._anchor
        length = max(0, len(context) - self.answer_start)  # the answer's
        if at is not None and length >= at[0]:  # the answer went on since the last call
            n, pos = at
            grown = context[self.answer_start + n:]
            m = common_prefix(grown, self.prediction[pos:pos + len(grown)])
            if m == len(grown):  # along the prediction
                self._at = (length, pos + m)
                return self._at[1]
            anchor = pos + m  # where it departed
        self._run = False  # not along the prediction: any run is over
        tail = context[max(self.answer_start, len(context) - MAX_MATCH):]
        found = realign(self._index, tail, anchor, long_only=self.misses >= QUIET_AFTER)
        self._anchor = anchor
        self._at = (length, found[0]) if found is not None else None
        self._sure = found is not None and found[1] >= LONG_MATCH
        return found[0] if found is not None else None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        pos = self._align(context)
        if pos is None or pos >= len(self.prediction):
            return EMPTY_DRAFT
        n = min(k, self.window)
        if n <= 0:
            return EMPTY_DRAFT
        self._drafted_in_run = self._run
        return Draft(self.prediction[pos:pos + n], None, (time.perf_counter() - t0) * 1e3)

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        """Acceptance learnt from each draft; a draft with nothing accepted is a miss."""
        if drafted <= 0:
            return
        self.every = self.every.seen(drafted, accepted)
        if self._drafted_in_run:
            self.on_run = self.on_run.seen(drafted, accepted)
        self.misses = 0 if accepted else self.misses + 1
        self._run = in_run(drafted, accepted, self._drafted_in_run)

    def close(self) -> None:
        self.start(self.params)
