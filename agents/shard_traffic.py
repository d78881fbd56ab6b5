"""The shard flow of a sharded verifier, counted on rank 0: bytes and milliseconds per forward.

Bytes are exact, from the shapes each mode moves; milliseconds are priced, the forward's
collectives (`topology.moe.ring_rounds`) x the ring latency rank 0 measures on its command
broadcasts (docs/agents.md, "shard_traffic.py").
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from macfleet.stats import ShardStats

ACT_ITEMSIZE = 4  # pipeline hops and logits travel as float32 (agents/shard.py)
PINGS = 31  # command broadcasts the ring's latency is the median of


def tensor_bytes(layers: int, tokens: int, hidden: int, itemsize: int) -> int:
    return 2 * layers * tokens * hidden * itemsize


def pipeline_bytes(ranks: int, tokens: int, hidden: int, vocab: int, want_logits: bool) -> int:
    return ((ranks - 1) * tokens * hidden + (tokens * vocab if want_logits else 0)) * ACT_ITEMSIZE


@dataclass(frozen=True)
class BlockShard:
    """What one block added to a generation's shard flow."""

    bytes: int
    ms: float  # measured inside the collectives (expert mode's host-routed forwards)
    priced_ms: float  # every mode: collectives x the ring's measured latency
    rank_load: tuple[int, ...]


def block_delta(prev: ShardStats | None, now: ShardStats | None) -> BlockShard:
    if now is None:
        return BlockShard(0, 0.0, 0.0, ())
    if prev is None:
        return BlockShard(now.collective_bytes, now.collective_ms, now.priced_ms, now.rank_load)
    return BlockShard(now.collective_bytes - prev.collective_bytes,
                      now.collective_ms - prev.collective_ms, now.priced_ms - prev.priced_ms,
                      tuple(a - b for a, b in zip(now.rank_load, prev.rank_load)))


class ShardTraffic:
    """Mutable tally of one generation (reset with the verifier); `stats()` is the record."""

    def __init__(self, mode: str, ranks: int, control_bytes_per_command: int) -> None:
        self.mode, self.ranks = mode, ranks
        self._control = control_bytes_per_command
        self._pings: deque[float] = deque(maxlen=PINGS)  # kept across generations
        self.reset()

    def reset(self) -> None:
        self.forwards = self.tokens = self.collective_bytes = self.control_bytes = 0
        self.forward_ms = self.priced_ms = 0.0

    def command(self, ms: float | None = None) -> None:
        """A command broadcast; `ms`: how long it took rank 0 (the ring's latency)."""
        self.control_bytes += self._control
        if ms is not None:
            self._pings.append(ms)

    @property
    def ring_ms(self) -> float:
        """The median of the recent command broadcasts' times (0 before any)."""
        return statistics.median(self._pings) if self._pings else 0.0

    def forward(self, tokens: int, nbytes: int, ms: float, rounds: float = 0.0) -> None:
        self.forwards += 1
        self.tokens += tokens
        self.collective_bytes += nbytes
        self.forward_ms += ms
        self.priced_ms += rounds * self.ring_ms

    def stats(self, *, collective_bytes: int = 0, collective_ms: float = 0.0,
              expert_load: tuple[int, ...] = (), rank_load: tuple[int, ...] = ()) -> ShardStats:
        """The record; expert mode adds what its blocks counted (bytes, ms, router load)."""
        return ShardStats(mode=self.mode, ranks=self.ranks, forwards=self.forwards,
                          tokens=self.tokens,
                          collective_bytes=self.collective_bytes + collective_bytes,
                          control_bytes=self.control_bytes, forward_ms=self.forward_ms,
                          collective_ms=collective_ms, priced_ms=self.priced_ms,
                          expert_load=expert_load,
                          rank_load=rank_load)
