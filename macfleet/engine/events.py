"""Typed events of the spec-decode loop, and the statistics it reduces them to."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TokensCommitted:
    """Tokens the verifier has committed (final: never retracted)."""

    block: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class BlockDone:
    block: int
    k: int  # drafts asked for
    drafted: int  # drafts received and verified
    accepted: int
    committed: int
    draft_ms: float  # wall time waiting for the proposer (compute + wire when remote)
    verify_ms: float
    block_ms: float


@dataclass(frozen=True)
class GenerationStats:
    tokens: int = 0
    elapsed_s: float = 0.0
    prefill_ms: float = 0.0
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    proposer: str = "none"
    finish_reason: str = ""
    accepted_hist: tuple[int, ...] = ()  # blocks with k > 0, by accepted length
    extra: dict[str, float] = field(default_factory=dict)  # e.g. flow bytes/ms when remote

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prompt was processed (what mlx-lm reports)."""
        t = self.elapsed_s - self.prefill_ms / 1e3
        return self.tokens / t if t > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        n = sum(self.accepted_hist)
        return sum(i * c for i, c in enumerate(self.accepted_hist)) / n if n else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accepted_hist"] = list(self.accepted_hist)
        d.update(tokens_per_s=self.tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s, acceptance=self.acceptance,
                 mean_accepted=self.mean_accepted)
        return d


@dataclass(frozen=True)
class Finished:
    stats: GenerationStats
    token_ids: tuple[int, ...]


Event = TokensCommitted | BlockDone | Finished
