"""Short, fixed-width renderings of fleet numbers, so columns fit an 80-column terminal."""

from __future__ import annotations

import time

DASH = "—"
_GIB = 1024**3


def fmt_ms(ms: float | None) -> str:
    """Milliseconds with about three significant digits; ``—`` when unknown."""
    if ms is None:
        return DASH
    if ms < 10:
        return f"{ms:.2f}"
    if ms < 100:
        return f"{ms:.1f}"
    if ms < 10_000:
        return f"{ms:.0f}"
    return f"{ms / 1000:.0f}s"


def fmt_bytes(n: float) -> str:
    """Decimal units (bytes on a wire, not memory pages): ``512B``, ``41.0kB``, ``3.2MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}B"


def fmt_mem(used: int, total: int) -> str:
    """``41/192G 21%``: memory is what decides which models fit where."""
    if total <= 0:
        return DASH
    return f"{used / _GIB:.0f}/{total / _GIB:.0f}G {100 * used / total:.0f}%"


def fmt_age(age_s: float | None) -> str:
    """Heartbeat age: ``0.4s``, ``12s``, ``3m``, ``2h``."""
    if age_s is None:
        return DASH
    if age_s < 10:
        return f"{age_s:.1f}s"
    if age_s < 120:
        return f"{age_s:.0f}s"
    if age_s < 7200:
        return f"{age_s / 60:.0f}m"
    return f"{age_s / 3600:.0f}h"


def fmt_pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def fmt_clock(t: float) -> str:
    """Local wall-clock time of day, as the event log and stall notice show it."""
    return time.strftime("%H:%M:%S", time.localtime(t))


def clip(text: str, width: int) -> str:
    """Cut ``text`` to ``width`` cells with an ellipsis, so one long model id cannot push
    every other column off an 80-column screen."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
