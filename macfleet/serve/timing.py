"""Per-session latencies as a client sees them (time to first token, gaps between blocks), kept
by both engines for the dashboard's `ServedSession`.
"""

from __future__ import annotations

from collections import deque

from macfleet.fleet.batch import percentile

MAX_GAPS = 1024  # gaps kept per session for its p50/p99 (a long answer keeps its latest)
RECENT_SESSIONS = 16  # ended sessions still reported, so short requests are seen at all


class TokenTimes:
    """When one session's blocks arrived, on the engine's clock (seconds)."""

    __slots__ = ("queued_at", "first", "last", "gaps")

    def __init__(self, queued_at: float) -> None:
        self.queued_at = queued_at
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: deque[float] = deque(maxlen=MAX_GAPS)

    def commit(self, now: float) -> None:
        """A block of one or more tokens reached the client's queue at ``now``."""
        if self.last is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first is None else (self.first - self.queued_at) * 1e3

    def itl_ms(self, q: float) -> float | None:
        """The q-quantile of the gaps between blocks (None before the second block)."""
        p = percentile(list(self.gaps), q)
        return None if p is None else p * 1e3
