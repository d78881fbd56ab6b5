"""Adaptive draft length: choose k for the next block from what has been measured.

With per-token acceptance alpha a block of k drafts commits E(k) = (1 - alpha^(k+1)) /
(1 - alpha) tokens (Leviathan et al.) and costs k * c + v(k + 1), v fitted as a + b * (L - 1);
the k in 0..k_max maximising their ratio is chosen (0: plain decoding). Backed off to 0, it
probes a short block at a growing interval, to notice drafts matching again at bounded cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The draft length a request may name, defined once for the CLI, the loops and both agents' checks
# (a length the CLI accepts but an agent refused would quietly become plain decoding).
AUTO = "auto"
MAX_DRAFT_TOKENS = 64
DraftTokens = int | str  # AUTO or 0..MAX_DRAFT_TOKENS

DEFAULT_K_MAX = 12
DEFAULT_EMA = 0.15
DEFAULT_PROBE_K = 2
DEFAULT_PROBE_MIN = 4
DEFAULT_PROBE_MAX = 64


def expected_tokens(alpha: float, k: int) -> float:
    """Expected committed tokens of a block with k drafts (including the verifier's token)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, draft_ms: float, verify_a: float, verify_b: float, k_max: int) -> int:
    """The k maximising expected tokens per millisecond (0 = plain decoding)."""
    best, best_rate = 0, 1.0 / max(verify_a, 1e-6)
    for k in range(1, k_max + 1):
        t = k * draft_ms + verify_a + verify_b * k
        rate = expected_tokens(alpha, k) / max(t, 1e-6)
        if rate > best_rate * 1.02:  # a small margin: only speculate when it clearly pays
            best, best_rate = k, rate
    return best


def tokens_to_wait(have: int, k: int, alpha: float, token_ms: float, due_ms: float,
                   verify_ms) -> int:
    """How many more streamed drafts to wait for before verifying (0: verify what is there),
    maximising expected committed tokens per ms, waiting included. have: drafts there; k: the
    block's most; token_ms: per drafted token; due_ms: until the next; verify_ms(L)."""
    best, best_rate = 0, expected_tokens(alpha, have) / max(verify_ms(have + 1), 1e-6)
    for j in range(1, k - have + 1):
        t = due_ms + (j - 1) * token_ms + verify_ms(have + j + 1)
        rate = expected_tokens(alpha, have + j) / max(t, 1e-6)
        if rate > best_rate:
            best, best_rate = j, rate
    return best


@dataclass
class FixedDraftLength:
    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, k: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        pass


@dataclass
class AdaptiveDraftLength:
    """EMA estimates of acceptance and costs -> `best_k`; probes after backing off to 0."""

    k_max: int = DEFAULT_K_MAX
    alpha: float = 0.6  # optimistic prior so speculation is tried first
    draft_ms: float | None = None  # per drafted token
    verify_a: float | None = None  # verify(1)
    verify_b: float | None = None  # extra per token beyond 1
    ema: float = DEFAULT_EMA
    probe_interval: int = DEFAULT_PROBE_MIN
    _since_probe: int = 0
    _probing: bool = False  # the last block was a probe (its failure doubles the interval)
    _samples: list[tuple[int, float]] = field(default_factory=list)
    last_k: int = 0

    def next_k(self) -> int:
        if self.verify_a is None or self.draft_ms is None:
            self.last_k = min(4, self.k_max)
            return self.last_k
        k = best_k(self.alpha, self.draft_ms, self.verify_a, self.verify_b or 0.0, self.k_max)
        self._probing = False
        if k == 0:
            self._since_probe += 1
            if self._since_probe >= self.probe_interval:
                self._since_probe = 0
                self._probing = True
                k = min(DEFAULT_PROBE_K, self.k_max)
        self.last_k = k
        return k

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def observe(self, k: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        """k: drafts actually verified this block (may be fewer than asked)."""
        self._samples.append((k + 1, verify_ms))
        del self._samples[:-32]
        self._fit_verify()
        if k > 0:
            self.draft_ms = self._mix(self.draft_ms, draft_ms / k)
            # per-token acceptance, maximum likelihood for a geometric run of successes
            trials = accepted + (1 if accepted < k else 0)
            if trials:
                self.alpha = min(0.98, max(0.0, self._mix(self.alpha, accepted / trials)))
            if accepted == 0 and self._probing:
                self.probe_interval = min(DEFAULT_PROBE_MAX, self.probe_interval * 2)
            elif accepted > 0:
                self.probe_interval = DEFAULT_PROBE_MIN
        elif self.draft_ms is None:
            self.draft_ms = 0.0 if draft_ms == 0 else draft_ms

    def _fit_verify(self) -> None:
        xs = [L for L, _ in self._samples]
        ys = [t for _, t in self._samples]
        n = len(xs)
        mx_, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx_) ** 2 for x in xs)
        if var > 0:
            b = max(0.0, sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / var)
        else:
            b = self.verify_b if self.verify_b is not None else 0.05 * my
        a = max(1e-3, my - b * (mx_ - 1))
        self.verify_a, self.verify_b = a, b


def check_draft_tokens(draft_tokens: DraftTokens) -> DraftTokens:
    """AUTO, or a whole number (an int or its digits) in 0..MAX_DRAFT_TOKENS; else ValueError."""
    if draft_tokens == AUTO:
        return AUTO
    try:
        k = int(draft_tokens) if not isinstance(draft_tokens, (bool, float)) else None
    except ValueError:
        k = None
    if k is None or not 0 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft tokens must be 0..{MAX_DRAFT_TOKENS} or '{AUTO}', "
                         f"got {draft_tokens!r}")
    return k


def parse_draft_tokens(text: str) -> DraftTokens:
    """A command-line value: 'auto' or a whole number in range; ValueError otherwise."""
    if text == AUTO:
        return AUTO
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"must be a whole number or '{AUTO}', got '{text}'") from None
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"must be 0..{MAX_DRAFT_TOKENS}, got {k}")
    return k


def make_controller(draft_tokens: DraftTokens):
    """AUTO -> AdaptiveDraftLength; an int -> FixedDraftLength (0 = plain decoding)."""
    if check_draft_tokens(draft_tokens) == AUTO:
        return AdaptiveDraftLength()
    return FixedDraftLength(int(draft_tokens))
