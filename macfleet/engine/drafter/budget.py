"""How big a draft tree pays: pure decisions from the head's confidence and verify(L).

A dynamic tree (EAGLE-2) ranks candidate nodes by the head's cumulative probability. When the
head is calibrated, the expected number of accepted tokens of a tree is the sum of its nodes'
cumulative probabilities (a node is accepted exactly when its whole path is), so a tree of the
N best nodes commits E(N) = 1 + g * sum(p_1..p_N) tokens per block, where g corrects the
head's calibration from what was actually accepted. It costs verify(N + 1). The tree size is
the N that maximises E(N) / verify(N + 1); N = 0 is plain decoding.

verify(L) is learnt online from the blocks the loop verifies (a least-squares line over the
recent (L, ms) pairs, held to a prior slope until several lengths have been seen), because it is
a property of the verifier's machine: flat on a Mac GPU, steeper on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_SLOPE = 0.05  # verify(L) / verify(1) grows ~5% per extra token on the machines measured
DEFAULT_WINDOW = 48
MIN_GAIN, MAX_GAIN = 0.1, 2.0


@dataclass
class VerifyCurve:
    """verify(L) in ms from observed blocks: a + b * (L - 1), b >= 0."""

    prior_slope: float = PRIOR_SLOPE
    window: int = DEFAULT_WINDOW
    samples: list[tuple[int, float]] = field(default_factory=list)

    def observe(self, length: int, ms: float) -> None:
        if length >= 1 and ms > 0:
            self.samples.append((length, ms))
            del self.samples[: -self.window]

    def fit(self) -> tuple[float, float]:
        """(a, b) in ms; (1, prior) in relative units before anything was seen."""
        if not self.samples:
            return 1.0, self.prior_slope
        xs = [L - 1 for L, _ in self.samples]
        ys = [ms for _, ms in self.samples]
        n = len(xs)
        mx_, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx_) ** 2 for x in xs)
        prior_b = self.prior_slope * max(min(ys), 1e-6)
        if var <= 0 or len({L for L, _ in self.samples}) < 3:
            b = prior_b
        else:  # shrink toward the prior with few distinct lengths (a ridge with weight 4)
            cov = sum((x - mx_) * (y - my) for x, y in zip(xs, ys))
            b = max(0.0, (cov + 4.0 * prior_b) / (var + 4.0))
        a = max(1e-6, my - b * mx_)
        return a, b

    def costs(self, n_max: int) -> list[float]:
        """verify(N + 1) for N = 0..n_max."""
        a, b = self.fit()
        return [a + b * n for n in range(n_max + 1)]


def choose_tree_size(probs: Sequence[float], costs: Sequence[float], gain: float = 1.0,
                     margin: float = 1.02) -> int:
    """N in 0..len(probs) maximising (1 + gain * sum(probs[:N])) / costs[N].

    probs: cumulative path probabilities, best first; costs[N] = verify(N + 1). A tree must
    beat plain decoding by `margin` to be chosen."""
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
    """Is one more depth of a draft tree worth a head forward? (pure)

    The children of the beam together are accepted at most as often as the beam itself
    (a child needs its parent), so the level can add at most gain * sum(beam_probs) expected
    tokens, each worth one verifier step (step_ms) of plain decoding; it costs depth_ms of
    drafting now. Which of its nodes are then verified is choose_tree_size's decision."""
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
    """When a drafter keeps choosing an empty tree, stop paying even for the root of its
    draft: skip a growing number of blocks, then probe again. Keeps a drafter that has nothing
    to say on this text near plain-decoding speed. (Drafts that miss are the calibration's
    business: it shrinks the trees until they are empty, and then this takes over.)"""

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
