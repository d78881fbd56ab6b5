"""What the batch's forwards cost, measured as they run: the prices of the scheduler's pure
plans (the stall control, a line and a curve of iterations by tokens, the step of chains
drafted together, the pool of recent blocks' acceptance).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from macfleet.engine.tree_budget import VerifyCurve
from macfleet.fleet.batch import IterationView
from macfleet.serve.scheduler import IterationCost, StallControl, ema

POOL_BLOCKS = 256  # recent drafted blocks whose acceptance every session's estimate leans on


class BatchCosts:
    """probe: measures the model's verify(L) table (engine/verify_costs.py) when a tree
    drafter's session first joins; never to size chunks (it would stall the sessions the
    chunks are sized for)."""

    def __init__(self, model, stall_ratio: float,
                 probe: Callable[[object], dict[int, float]]) -> None:
        self.model, self._probe = model, probe
        self.stall = StallControl(stall_ratio)  # its cost curve: at the first chunk
        self._stall_checked = False
        self.line = IterationCost()  # iterations' ms vs tokens, for draft lengths
        self._curve: VerifyCurve | None = None  # decode iterations' ms by tokens
        self.step_ms: float | None = None  # one draft position of the chains drafted together
        self.pool: deque[tuple[int, int]] = deque(maxlen=POOL_BLOCKS)  # (trials, accepted)
        self.table: dict[int, float] | None = None  # verify(L), read when a group joins

    def chunk_budget(self, decoding: int, prefilling: int, token_budget: int) -> int:
        """The token budget of an iteration where `prefilling` prompts arrive while
        `decoding` sessions decode (the stall control's)."""
        if not self._stall_checked:
            self.stall.curve, self._stall_checked = self.stall_curve(), True
        return self.stall.budget(decoding, token_budget, waiting=prefilling, decoding=decoding)

    def stall_curve(self) -> VerifyCurve | None:
        """This machine's verify(L) table as a curve when one is already known (never probed
        here); None: the stall control follows its measurements alone."""
        from macfleet.engine.verify_costs import known_verify_costs

        costs = self.table if self.table is not None else known_verify_costs(self.model)
        if not costs:
            return None
        curve = VerifyCurve()
        curve.seed(costs)
        return curve

    def verify_costs(self) -> dict[int, float]:
        """The model's measured verify(L) table (what a group of drafters is seeded with;
        probed once per machine, on this thread, then cached on disk)."""
        if self.table is None:
            self.table = self._probe(self.model)
            if self.stall.curve is None:  # now known: the stall control sizes chunks by it
                self.stall.curve, self._stall_checked = self.stall_curve(), True
        return self.table

    def curve(self) -> VerifyCurve:
        if self._curve is None:
            self._curve = self.stall_curve() or VerifyCurve()
        return self._curve

    def batch_cost(self) -> Callable[[int], float] | None:
        """What a forward over n tokens costs this batch: its decode iterations' curve, else
        the line through recent iterations; None before anything is measured."""
        if self.curve().samples:
            return self._curve.cost
        if self.line.predict(1) is None:
            return None
        return lambda n: self.line.predict(n)

    def without(self, ms: float, tokens: int, fewer: int) -> float:
        """`ms` of a forward of `tokens`, priced without `fewer` of them (`batch_cost`): what
        a session's drafters learn of a block a prediction made longer."""
        cost = self.batch_cost()
        if cost is None or fewer <= 0 or tokens - fewer < 1:
            return ms
        return ms * cost(tokens - fewer) / cost(tokens)

    def observe(self, rec: IterationView) -> None:
        """One iteration's forward, measured."""
        self.stall.observe(rec.prefill_tokens, rec.decode_tokens, rec.ms)
        self.line.observe(rec.decode_tokens + rec.prefill_tokens, rec.ms)
        if rec.prefill_tokens == 0:
            self.curve().observe(rec.decode_tokens, rec.ms)

    def observe_step(self, step_ms: float) -> None:
        """One draft position of the chains drafted together took `step_ms`."""
        self.step_ms = ema(self.step_ms, step_ms)

    def observe_block(self, trials: int, accepted: int) -> None:
        """A drafted block's geometric trials and accepted drafts, for the pool."""
        self.pool.append((trials, accepted))

    def pool_totals(self) -> tuple[int, int]:
        """(trials, accepted) of the recent drafted blocks of every session."""
        return sum(n for n, _ in self.pool), sum(acc for _, acc in self.pool)
