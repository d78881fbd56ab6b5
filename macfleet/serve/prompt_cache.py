"""A prompt cache across requests: the KV finished requests leave, reused by later prompts
that start the same (a chat re-sends its whole history every turn). Copied keys are the very
numbers the earlier forward wrote, so a greedy answer does not change; entries are partitioned
so a hit never tells one API key another's prompts. docs/serving.md, "prompt_cache.py".
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
        # the first `best` positions, a view (the entry stays alive while it is installed)
        return best, tuple((k[:, :best], v[:, :best]) for k, v in self._entries[key].kv)

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
