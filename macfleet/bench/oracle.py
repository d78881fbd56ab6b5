"""The oracle: drafts a known reference (prompt + the run's own answer), so every block is
accepted in full and the run's speed is the loop's own (`macfleet bench overhead`); a measuring
instrument, not a drafter for users, so it lives with the benchmarks (docs/drafters.md,
"oracle.py")."""

from __future__ import annotations

import time
from collections.abc import Sequence

from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer


class OracleProposer(Proposer):
    name = "oracle"

    def __init__(self, reference: Sequence[int]) -> None:
        if not reference:
            raise ValueError("the oracle needs a non-empty reference (prompt + answer)")
        self.reference = tuple(int(t) for t in reference)
        self.departures = 0  # calls whose context had left the reference
        self.first_departure: int | None = None  # context length at the first such call

    def start(self, params=None) -> None:
        self.params = params
        self.departures, self.first_departure = 0, None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or not context:
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        n = len(context)
        # only the last token is checked: the drafts it accepted are the reference's
        if not (n <= len(self.reference) and int(context[-1]) == self.reference[n - 1]):
            self.departures += 1
            if self.first_departure is None:
                self.first_departure = len(context)
            return EMPTY_DRAFT
        return Draft(self.reference[n : n + k], None, (time.perf_counter() - t0) * 1e3)
