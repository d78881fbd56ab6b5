"""The oracle: drafts a known answer, so every draft is accepted when the run follows it.

A measuring instrument, not a drafter for users: with a reference sequence (prompt + answer)
in hand, it drafts the next k reference tokens at the current context position. When the
verifier commits exactly the reference, every block is accepted in full and the run's speed
is the loop's own (no rejection, no drafting cost): measured against the ideal speed-up read
off the verify(L) curve, it is the loop's efficiency (`macfleet bench overhead`).

The reference must be the run's own committed tokens: on a GPU in bfloat16 a block forward's
argmax can differ from a one-token forward's where the top two logits nearly tie, so a plain
run's answer is not always what block decoding commits. `follow_reference` (bench/overhead.py)
re-runs with the departed run's own output until a run accepts every draft.

Only the last context token is checked against the reference: the drafts it accepted are the
reference's by construction, so the first departure always enters as the verifier's own next
token, which is the context's last token at the next call. A context off the reference gets
an empty draft (a plain step), and the call is counted in `departures`.
"""

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

    def on_reference(self, context: Sequence[int]) -> bool:
        """Whether the context's last token is the reference's at that position."""
        n = len(context)
        return 0 < n <= len(self.reference) and int(context[-1]) == self.reference[n - 1]

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or not context:
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        if not self.on_reference(context):
            self.departures += 1
            if self.first_departure is None:
                self.first_departure = len(context)
            return EMPTY_DRAFT
        n = len(context)
        return Draft(self.reference[n : n + k], None, (time.perf_counter() - t0) * 1e3)
