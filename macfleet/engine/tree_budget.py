"""How big a draft tree pays: pure decisions from the head's confidence and verify(L).

A calibrated head's tree of the N best nodes commits E(N) = 1 + g * sum(p_1..p_N) tokens per
block (a node is accepted exactly when its whole path is; g corrects the calibration from what
was accepted) and costs verify(N + 1); the tree size is the N maximising their ratio (N = 0:
plain decoding). verify(L) is probed and learnt from every verified block, since it is the
verifier machine's: flat on a Mac GPU, a steep sawtooth on a CPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_SLOPE = 0.05  # verify(L) / verify(1)'s growth per extra token before one is measured
MIN_GAIN, MAX_GAIN = 0.1, 2.0


@dataclass
class VerifyCurve:
    """verify(L) in ms by length, probed (`seed`) and learnt (`observe`); a table, not a line,
    since a CPU's verify(L) is a sawtooth. Interpolated, extended with the prior slope."""

    ema: float = 0.25
    table: dict[int, float] = field(default_factory=dict)

    @property
    def samples(self) -> bool:
        """Anything measured yet (else costs are relative units of the prior)."""
        return bool(self.table)

    def seed(self, costs: dict[int, float]) -> None:
        """Measured verify(L) of the verifier (ms by L), e.g. from a probe."""
        for L, ms in costs.items():
            if int(L) >= 1 and ms > 0:
                self.table[int(L)] = float(ms)

    def observe(self, length: int, ms: float, ema: float | None = None) -> None:
        """One block's verify time at `length` (ema: this call's weight, default `ema`)."""
        if length >= 1 and ms > 0:
            old = self.table.get(length)
            a = self.ema if ema is None else ema
            self.table[length] = ms if old is None else (1 - a) * old + a * ms

    def cost(self, length: int) -> float:
        if not self.table:
            return 1.0 + PRIOR_SLOPE * (length - 1)
        if length in self.table:
            return self.table[length]
        below = [L for L in self.table if L < length]
        above = [L for L in self.table if L > length]
        if below and above:
            a, b = max(below), min(above)
            t = (length - a) / (b - a)
            return (1 - t) * self.table[a] + t * self.table[b]
        if above:  # shorter than anything measured: no cheaper than the shortest known
            return self.table[min(above)]
        a = max(below)
        return self.table[a] * (1.0 + PRIOR_SLOPE * (length - a))

    def costs(self, n_max: int) -> list[float]:
        """verify(N + 1) for N = 0..n_max."""
        return [self.cost(n + 1) for n in range(n_max + 1)]

    def block_costs(self, n_max: int, draft_ms: float) -> list[float]:
        """costs(n_max) with the block's drafting charged to every non-empty size (plain
        decoding drafts nothing); not before anything is measured (relative units)."""
        c = self.costs(n_max)
        return [c[0], *(x + draft_ms for x in c[1:])] if self.table else c


def choose_tree_size(probs: Sequence[float], costs: Sequence[float], gain: float = 1.0,
                     margin: float = 1.02) -> int:
    """N in 0..len(probs) maximising (1 + gain * sum(probs[:N])) / costs[N] (probs: path
    probabilities, best first; costs[N] = verify(N + 1)), beating plain by `margin`."""
    best, best_rate = 0, 1.0 / costs[0]
    total = 0.0
    for n, p in enumerate(probs[: len(costs) - 1], start=1):
        total += p
        rate = (1.0 + gain * total) / costs[n]
        if rate > best_rate and rate > margin / costs[0]:
            best, best_rate = n, rate
    return best


def worth_expanding(beam_probs: Sequence[float], gain: float, depth_ms: float,
                    step_ms: float) -> bool:
    """Is one more depth of a draft tree worth a head forward? (pure) A child needs its parent,
    so the level adds at most gain * sum(beam_probs) tokens, each worth a plain step (step_ms);
    it costs depth_ms."""
    return gain * float(sum(beam_probs)) * step_ms > depth_ms


@dataclass
class Calibration:
    """g = accepted / predicted over recent blocks (EMA of both sums)."""

    ema: float = 0.1
    predicted: float = 1.0
    accepted: float = 1.0

    @property
    def gain(self) -> float:
        return min(MAX_GAIN, max(MIN_GAIN, self.accepted / max(self.predicted, 1e-6)))

    def observe(self, predicted: float, accepted: int) -> None:
        self.predicted = (1 - self.ema) * self.predicted + self.ema * predicted
        self.accepted = (1 - self.ema) * self.accepted + self.ema * accepted


@dataclass
class Backoff:
    """When a drafter keeps choosing an empty tree, skip a growing number of blocks, then probe
    again: a drafter with nothing to say stays near plain-decoding speed (drafts that miss
    shrink the trees through the calibration until they are empty)."""

    patience: int = 3  # empty drafts in a row before skipping
    max_skip: int = 16
    _misses: int = 0
    _skip: int = 0
    _skip_len: int = 2

    def should_draft(self) -> bool:
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            if accepted > 0:
                self._misses, self._skip_len = 0, 2
            return
        self._misses += 1
        if self._misses >= self.patience:
            self._misses = 0
            self._skip = self._skip_len
            self._skip_len = min(self.max_skip, self._skip_len * 2)


class TreeSizing:
    """A tree drafter's sizing (eagle2's, the answer store's): each tree's node count chosen
    against verify(L) (`curve`) and the head's calibration."""

    def __init__(self) -> None:
        self.curve, self.calibration = VerifyCurve(), Calibration()
        self.predicted = 0.0  # the sum of the last tree's node probabilities: the accepted
        # drafts it expects, before the calibration (read by `auto`'s chooser too)

    def size(self, probs: Sequence[float], t0: float) -> int:
        """How many of the nodes (path probabilities, best first) to draft: a tree must pay
        for its drafting too (since perf_counter `t0`), charged to every non-empty size."""
        costs = self.curve.block_costs(len(probs), (time.perf_counter() - t0) * 1e3)
        n = choose_tree_size(probs, costs, self.calibration.gain)
        self.predicted = sum(probs[:n])
        return n

    def seed_verify_costs(self, costs) -> None:
        self.curve.seed(costs)

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        self.curve.observe(verified or drafted + 1, verify_ms)
        if drafted:
            self.calibration.observe(self.predicted, accepted)
