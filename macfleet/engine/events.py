"""Typed events of the spec-decode loop; the statistics it reduces them to are
`macfleet.stats.GenerationStats` (the record that travels to the terminal)."""

from __future__ import annotations

from dataclasses import dataclass

from macfleet.stats import GenerationStats


@dataclass(frozen=True)
class TokensCommitted:
    """Tokens the verifier has committed (final: never retracted)."""

    block: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class BlockDone:
    block: int
    k: int  # drafts asked for
    drafted: int  # drafts received and verified
    accepted: int
    committed: int
    draft_ms: float  # wall time waiting for the proposer (compute + wire when remote)
    verify_ms: float
    block_ms: float
    drafter: str = ""  # `--proposer auto`: the candidate that drafted it (engine/chooser.py)
    why: str = ""  # and why it was chosen (stats.CHOICE_REASONS)


@dataclass(frozen=True)
class Finished:
    stats: GenerationStats
    token_ids: tuple[int, ...]


Event = TokensCommitted | BlockDone | Finished

__all__ = ["TokensCommitted", "BlockDone", "Finished", "Event", "GenerationStats"]
