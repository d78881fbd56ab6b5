"""Benchmarks: measured side by side in one run, written to results/ with the command."""

from __future__ import annotations

import math
from collections.abc import Iterable


def geomean(xs: Iterable[float]) -> float:
    """The geometric mean of the positive values (0.0: none): a speed-up over prompts, so one
    long prompt cannot hide a slow one."""
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0
