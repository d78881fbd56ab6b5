"""A prompt cache across requests: the KV of finished requests, reused by later prompts.

Every turn of a chat re-sends the whole history; without a cache each turn prefills it all
again, so time to first token grows with the conversation. Here the KV a finished request
leaves (its prompt and its answer, per layer [kv_heads, n, head_dim], copied out of its batch
row) is kept, least recently used first out, within a byte budget; a new request copies the
longest cached prefix of its prompt into its row (`BatchKV.install`, spread over iterations
like a shipped KV) and prefills only the rest. Copying a key is not computing it: the cached
positions hold the very numbers the earlier forward wrote, so a greedy answer is the one the
same prompt gets without the cache (up to the flat batch's chunk-shape noise: tests compare
greedy ids).

Lookup is a scan over the entries with one vectorised compare each (numpy): entries number in
the tens to hundreds under a memory budget, far cheaper than the prefill a hit saves.
One cache per engine, so per model, partitioned: an entry answers only lookups of its own
partition (`serve` gives each API key one when it has several), so a hit — `cached_tokens`, a
shorter time to first token — never tells one key what another key's prompts were. The byte
budget is shared: a partition's entries may push out another's (that only costs it prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from macfleet.fleet.batch import PromptCacheView

MIN_CACHED_PREFIX = 16  # shorter hits are not worth an install (the chat template's head)

KV = tuple[tuple[mx.array, mx.array], ...]  # per layer (keys, values) [kv_heads, n, head_dim]


@dataclass
class _Entry:
    tokens: np.ndarray  # int64 [n]
    kv: KV
    nbytes: int
    partition: str = ""


def kv_bytes(kv: KV) -> int:
    return sum(k.nbytes + v.nbytes for k, v in kv)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def row_kv(store, row: int, n: int) -> KV:
    """Positions [0, n) of one row of a `BatchKV`, copied out (a gather: a slice would keep the
    whole buffer alive and stop the store's in-place writes)."""
    idx = mx.arange(n)
    kv = tuple((mx.take(store.keys[i][row], idx, axis=1),
                mx.take(store.values[i][row], idx, axis=1)) for i in range(store.n_layers))
    mx.eval(kv)
    return kv


def slice_kv(kv: KV, n: int) -> KV:
    """The first n positions (a view is fine: the cache entry stays alive while installing)."""
    return tuple((k[:, :n], v[:, :n]) for k, v in kv)


class PromptCache:
    """Finished requests' KV by token prefix, LRU within `max_bytes`."""

    def __init__(self, max_bytes: int, min_tokens: int = MIN_CACHED_PREFIX) -> None:
        if max_bytes <= 0:
            raise ValueError("a prompt cache needs a positive byte budget")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._next = 0
        self.bytes = self.lookups = self.hits = self.saved_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], partition: str = "") -> tuple[int, KV | None]:
        """The longest cached prefix of prompt[:-1] (the last token is always fed: its logits
        start the answer) among `partition`'s entries: (n, the KV of those n positions), or
        (0, None) below min_tokens."""
        self.lookups += 1
        target = np.asarray(prompt[:-1], dtype=np.int64)
        best, key = 0, None
        for k, e in self._entries.items():
            if e.partition != partition:
                continue
            n = common_prefix_len(target, e.tokens)
            if n > best:
                best, key = n, k
        if key is None or best < self.min_tokens:
            return 0, None
        self._entries.move_to_end(key)
        self.hits += 1
        self.saved_tokens += best
        return best, slice_kv(self._entries[key].kv, best)

    def insert(self, tokens: Sequence[int], kv: KV, partition: str = "") -> bool:
        """Keep the KV of `tokens` (one position each) for `partition`'s lookups; its entries
        this one extends are dropped (it answers every lookup they would). False when it does
        not fit the budget at all."""
        toks = np.asarray(tokens, dtype=np.int64)
        if len(toks) < self.min_tokens or kv[0][0].shape[1] != len(toks):
            return False
        nbytes = kv_bytes(kv)
        if nbytes > self.max_bytes:
            return False
        for k in [k for k, e in self._entries.items()
                  if e.partition == partition and len(e.tokens) <= len(toks)
                  and common_prefix_len(toks, e.tokens) == len(e.tokens)]:
            self._drop(k)
        while self.bytes + nbytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = _Entry(toks, kv, nbytes, partition)
        self._next += 1
        self.bytes += nbytes
        return True

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def stats(self) -> PromptCacheView:
        return PromptCacheView(len(self._entries), self.bytes, self.max_bytes, self.lookups,
                                self.hits, self.saved_tokens)


@dataclass(frozen=True)
class PromptReused:
    """Engine event, before a session's first tokens: prompt tokens it did not prefill (copied
    from the prompt cache, or from a live session's cache)."""

    tokens: int
