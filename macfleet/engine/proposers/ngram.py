"""N-gram prompt lookup: drafts what followed the most recent earlier occurrence of the
context's last n tokens (longest n first); free, and strong when the answer repeats its input."""

from __future__ import annotations

import time
from collections.abc import Sequence

from macfleet.engine.prefix import common_prefix
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer

DEFAULT_MAX_NGRAM = 3


class NgramProposer(Proposer):

    def __init__(self, max_n: int = DEFAULT_MAX_NGRAM) -> None:
        if max_n < 1:
            raise ValueError(f"need max_n >= 1, got {max_n}")
        self.name = f"ngram:{max_n}"
        self.max_n = max_n
        self.start()

    def start(self, params=None) -> None:
        self.params = params
        self._seen: list[int] = []
        # n -> n-gram -> end positions (index just past the n-gram), ascending
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(1, self.max_n + 1)}

    def close(self) -> None:
        self.start(self.params)

    def _extend(self, context: Sequence[int]) -> None:
        if len(context) < len(self._seen) or list(context[: len(self._seen)]) != self._seen:
            self._truncate(common_prefix(self._seen, context))
        start = len(self._seen)
        self._seen.extend(int(t) for t in context[start:])
        for end in range(start + 1, len(self._seen) + 1):  # the ends not indexed yet
            for n, idx in self._index.items():
                if end >= n:
                    idx.setdefault(tuple(self._seen[end - n : end]), []).append(end)

    def _truncate(self, keep: int) -> None:
        """Forget the positions past `keep` (a pre-draft's guessed tokens the verifier did not
        commit): each end's entry is the last of its n-gram's list, so this is O(dropped)."""
        for end in range(len(self._seen), max(keep, 0), -1):
            for n, idx in self._index.items():
                if end >= n:
                    key = tuple(self._seen[end - n : end])
                    ends = idx[key]
                    ends.pop()
                    if not ends:
                        del idx[key]
        del self._seen[keep:]

    def _lookup(self, seq: list[int], k: int) -> list[int]:
        for n in range(self.max_n, 0, -1):
            if len(seq) <= n:
                continue
            ends = self._index[n].get(tuple(seq[-n:]), [])
            for end in reversed(ends):
                if end < len(seq):  # an earlier occurrence, not the suffix itself
                    return seq[end : end + k]
        return []

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or not context:
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        self._extend(context)
        tokens = self._lookup(self._seen, k)
        return Draft(tuple(tokens), None, (time.perf_counter() - t0) * 1e3)
