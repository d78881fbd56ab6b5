"""Iteration-level scheduling (ORCA-style) as a pure function.

Before every forward the engine describes its active sessions (`SessionView`) and this decides
which of them run and with how many tokens, under a per-iteration token budget:

1. decoding sessions first, oldest first: each gets its speculative block (1 + drafts); when
   the blocks do not fit, drafts are cut (never below the one token a decode step needs), so a
   decoding session is never starved by anyone;
2. the budget left goes to prefill chunks, oldest first (chunked prefill): a long prompt is fed
   a chunk per iteration, and the decoding sessions keep their pace while it arrives.

`chunked=False` gives a prefill its whole prompt in one iteration (the stall that chunking
avoids; kept to measure it). `align` makes chunk ends multiples of `align` tokens, the shapes a
session processed alone would see (batch-invariant mode); one such chunk per iteration may
overrun the budget, so a prompt is never starved by decoding sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TOKEN_BUDGET = 256


@dataclass(frozen=True)
class SessionView:
    sid: int
    prefill_left: int  # prompt tokens still to feed (0: decoding)
    prefill_done: int = 0  # prompt tokens already in the cache
    want: int = 1  # decoding: 1 + drafts it would like verified


@dataclass(frozen=True)
class Slot:
    sid: int
    tokens: int  # decoding: block length (1 + drafts); prefill: chunk length
    prefill: bool


def plan_iteration(sessions: Sequence[SessionView], budget: int = DEFAULT_TOKEN_BUDGET, *,
                   chunked: bool = True, align: int = 0) -> tuple[Slot, ...]:
    """The slots of the next forward, decoding sessions first (in the order given)."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    decoding = [s for s in sessions if s.prefill_left <= 0]
    prefilling = [s for s in sessions if s.prefill_left > 0]
    slots: list[Slot] = []
    # every decoding session gets at least one token; drafts share what is left, oldest first
    spare = budget - len(decoding)
    for s in decoding:
        extra = max(0, min(s.want - 1, spare))
        spare -= extra
        slots.append(Slot(s.sid, 1 + extra, False))
    left = budget - sum(s.tokens for s in slots)
    for s in prefilling:
        n = s.prefill_left
        if align:
            n = min(n, align - s.prefill_done % align)
        if chunked and align:
            if n > left and any(sl.prefill for sl in slots):
                break  # one aligned chunk per iteration may overrun the budget, not two
        elif chunked:
            n = min(n, left)
        if n <= 0:
            break
        slots.append(Slot(s.sid, n, True))
        left -= n
        if left <= 0:
            break
    return tuple(slots)


DEFAULT_STALL_RATIO = 2.0
MIN_PREFILL_CHUNK = 16


def fit_iteration_cost(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ms = a + b * tokens over (tokens, ms) samples; None until it is defined."""
    if len(samples) < 4:
        return None
    xs = [float(n) for n, _ in samples]
    ys = [ms for _, ms in samples]
    mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx_) ** 2 for x in xs)
    if var == 0:
        return None
    b = max(0.0, sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / var)
    return max(0.0, my - b * mx_), b


def stall_budget(decode_tokens: int, cost: tuple[float, float] | None, token_budget: int,
                 ratio: float = DEFAULT_STALL_RATIO, min_chunk: int = MIN_PREFILL_CHUNK) -> int:
    """The iteration's token budget so that it costs at most `ratio` x a decode-only one.

    A prefill chunk makes every decoding session wait for it: on a compute-bound machine
    (this CPU) each prefill token costs about as much as a decode token, on a bandwidth-bound
    GPU almost nothing. With the fitted cost ms = a + b * tokens, the chunk is sized so the
    decoders' inter-token latency stays within `ratio` of its plain value, and never below
    `min_chunk` tokens so a long prompt still moves."""
    if ratio <= 0 or decode_tokens == 0:
        return token_budget
    if cost is None:  # nothing measured yet: a small probe chunk (it also gives the fit a slope)
        return max(1, min(token_budget, decode_tokens + min_chunk))
    a, b = cost
    if b <= 0:
        return token_budget
    allowed = int((ratio * (a + b * decode_tokens) - a) / b)
    return max(1, min(token_budget, max(allowed, decode_tokens + min_chunk)))
