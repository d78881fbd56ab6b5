"""The verifier: the target model with a KV cache that rolls back in O(1): it scores a block
[last committed token, d_1 .. d_k] in one forward, then drops the rejected drafts' KV entries
by moving the cache offset (mlx-lm's `trim`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from macfleet.stats import ShardStats

DEFAULT_PREFILL_STEP = 512


class CacheError(ValueError):
    """The model's cache cannot be rolled back (speculative decoding needs trimmable caches)."""


def make_trimmable_cache(model: nn.Module) -> list:
    cache = make_prompt_cache(model)
    bad = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
    if bad:
        raise CacheError(f"speculative decoding needs a trimmable KV cache; this model uses {bad}")
    return cache


class Verifier:
    # Declared capability (what an agent may ask of a verifier): one whose peers must hear from
    # it while it is idle (a shard group's watchdogs) sets this and implements keepalive().
    needs_keepalive: bool = False

    def __init__(self, model: nn.Module, prefill_step: int = DEFAULT_PREFILL_STEP) -> None:
        self.model = model
        self.prefill_step = prefill_step
        self.cache = make_trimmable_cache(model)

    @property
    def offset(self) -> int:
        """Number of tokens whose keys/values are in the cache."""
        return int(self.cache[0].offset)

    def reset(self) -> None:
        self.cache = make_trimmable_cache(self.model)

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed tokens without needing their logits (chunked, like mlx-lm's prompt processing)."""
        for i in range(0, len(tokens), self.prefill_step):
            chunk = mx.array([int(t) for t in tokens[i : i + self.prefill_step]],
                             dtype=mx.uint32)[None]
            self.model(chunk, cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def forward(self, tokens: Sequence[int]) -> mx.array:
        """tokens: [L] -> logits [L, V] (float32), appending L entries to the cache."""
        x = mx.array([int(t) for t in tokens], dtype=mx.uint32)[None]
        return self.model(x, cache=self.cache)[0].astype(mx.float32)

    @property
    def pipelines(self) -> bool:
        """Whether this is the model's own forward, which the flat batch may run for it (a
        verifier that overrides `forward`, a sharded one, decodes on that forward instead)."""
        return type(self).forward is Verifier.forward

    def rollback(self, n: int) -> None:
        """Drop the last n cache entries (O(1): moves the offset)."""
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot roll back {n} of {self.offset} cached tokens")
        if n:
            for c in self.cache:
                c.trim(n)

    def shard_stats(self) -> ShardStats | None:
        """What crossed between shard ranks since the last reset (agents/shard.py); None: one
        process, nothing did."""
        return None

    def keepalive(self) -> None:
        """Called at least every keepalive period while idle, only when needs_keepalive."""

