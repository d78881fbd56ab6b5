"""`macfleet bench pair`: a big verifier and a real draft model, on one Mac and on two.

What it measures (issue 42), for each setting of the instrument (a wide SmolLM2 verifier,
bench/pair_model.py, whose draft-model acceptance is set by a dial; the draft model is the real
SmolLM2-135M), one Mac = one core:
(a) plain decoding, macfleet against mlx-lm's `generate_step`;
(b) the draft model in one process (drafting in series), macfleet against mlx-lm's
    `speculative_generate_step`, same pair, same k;
(c) two agents -- the verifier on core 0, a draft-model agent drafting ahead on core 1 -- against
    (b), and (d) against plain decoding and against the verifier agent alone;
beside each figure the speed-up that the measured costs and acceptance allow (`ceilings`), how
far ahead the draft agent ran and the share of its drafts thrown away. Greedy ids must be
identical across every run of a prompt.

This module is the arithmetic (pure); bench/pair_run.py runs the models and agents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from macfleet.engine.controller import expected_tokens

# Ordinary requests, none of them in the dial's calibration set (bench/pair_dial.py).
PAIR_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short Python function that returns the largest number in a list.",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Describe how a bicycle works to a ten-year-old.",
    "List five fruits that are rich in vitamin C.",
    "Why do we have seasons on Earth?",
    "Write a haiku about autumn leaves.",
)
DEFAULT_TOKENS = 96
DEFAULT_K = 4
MAX_CEILING_K = 16


@dataclass(frozen=True)
class Costs:
    """Measured on the core the run uses: verify(L) of the verifier in ms by L, and one
    draft-model token in ms."""

    verify_ms: Mapping[int, float]
    draft_ms: float

    def verify(self, L: int) -> float:
        """verify(L), linearly between (and beyond) the measured lengths."""
        ls = sorted(self.verify_ms)
        if L in self.verify_ms:
            return self.verify_ms[L]
        lo = max((x for x in ls if x < L), default=None)
        hi = min((x for x in ls if x > L), default=None)
        if lo is None:
            lo, hi = ls[0], ls[1] if len(ls) > 1 else ls[0]
        elif hi is None:
            lo, hi = (ls[-2], ls[-1]) if len(ls) > 1 else (ls[-1], ls[-1])
        if hi == lo:
            return self.verify_ms[lo]
        slope = (self.verify_ms[hi] - self.verify_ms[lo]) / (hi - lo)
        return self.verify_ms[lo] + slope * (L - lo)

    @property
    def c(self) -> float:
        """The cost ratio: one draft token / one verify(1)."""
        return self.draft_ms / self.verify(1)


def alpha_from_mean(mean_accepted: float, k: int) -> float:
    """Per-token acceptance a whose E[accepted drafts of a k-block] = mean_accepted: solves
    sum_{i=1..k} a^i = mean_accepted by bisection (0 <= mean <= k)."""
    m = max(0.0, min(float(k), mean_accepted))
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        got = sum(a ** i for i in range(1, k + 1))
        lo, hi = (a, hi) if got < m else (lo, a)
    return (lo + hi) / 2


def one_process_speedup(alpha: float, k: int, costs: Costs) -> float:
    """The standard formula: drafting in series, a block costs k draft steps + verify(k+1)."""
    return expected_tokens(alpha, k) * costs.verify(1) / (k * costs.draft_ms + costs.verify(k + 1))


def two_agent_speedup(alpha: float, k: int, costs: Costs) -> float:
    """Drafting ahead on a second machine at full overlap: a block costs the longer of its
    verify(k+1) and the k+1 draft steps the draft agent needs to stay ahead (k drafts and its
    guess of the verifier's next token); a refuted stream's restart is not counted, so this is
    a ceiling."""
    t = max(costs.verify(k + 1), (k + 1) * costs.draft_ms)
    return expected_tokens(alpha, k) * costs.verify(1) / t


def best_two_agent(alpha: float, costs: Costs, k_max: int = MAX_CEILING_K) -> tuple[int, float]:
    """The k with the highest two-agent ceiling, and that ceiling."""
    return max(((k, two_agent_speedup(alpha, k, costs)) for k in range(1, k_max + 1)),
               key=lambda kv: kv[1])


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def ratios(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-prompt ratios of two runs' tokens/s: geomean, min, max, and each."""
    rs = [a / b for a, b in zip(num, den) if a > 0 and b > 0]
    return {"geomean": geomean(rs), "min": min(rs, default=0.0), "max": max(rs, default=0.0),
            "each": rs}
