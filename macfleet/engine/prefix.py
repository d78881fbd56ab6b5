"""Leading tokens two sequences share: what a drafter's cache keeps of a new context, the
prompt prefix a new session copies (serve/scheduler.py, which imports it: no MLX, no numpy)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
