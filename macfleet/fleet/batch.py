"""A serving engine's continuous batch, as `macfleet serve` reports it and the dashboard shows it.

The server answers ``GET /v1/macfleet/batch`` (``BATCH_PATH``) with ``BatchView.to_dict()``; the
dashboard's poller (fleet/serve_watch.py) decodes it with ``BatchView.from_dict`` and wraps it in
a ``ServeView``, which also says why a server could not be read (down, wrong key, not macfleet).
Pure data (stdlib only), like snapshot.py: the engine, the HTTP app, recordings and the
dashboard share this one definition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# an iteration and a session are plain records (a verifier agent sends them too): their home
# is macfleet.stats; the server's batch view is made of them
from macfleet.stats import SESSION_STATES, IterationView, ServedSession

__all__ = ["BATCH_PATH", "ENGINE_MODES", "SESSION_STATES", "IterationView", "ServedSession",
           "BatchView", "ServeView", "percentile"]

BATCH_PATH = "/v1/macfleet/batch"
ENGINE_MODES = ("batched", "fleet")  # one flat forward per iteration here | each request
# forwarded to a verifier agent (whose own continuous batch the view shows)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (the rule bench serve uses); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


@dataclass(frozen=True, slots=True)
class PromptCacheView:
    """A server's prompt cache: its entries and bytes, and the prefill tokens it saved."""

    entries: int
    bytes: int
    max_bytes: int
    lookups: int
    hits: int
    saved_tokens: int


@dataclass(frozen=True, slots=True)
class BatchView:
    """A server's batch at one instant: load, recent iterations, live and recent sessions."""

    model: str
    mode: str  # one of ENGINE_MODES
    alive: bool  # False: no verifier (the server answers 503 to generation requests)
    active: int
    waiting: int
    iterations: int  # since the server started
    recent: tuple[IterationView, ...] = ()  # oldest first
    sessions: tuple[ServedSession, ...] = ()  # live ones, then recently ended ones
    prompt_cache: PromptCacheView | None = None  # serve --local's prompt cache, when on

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchView:
        """Decode; unknown keys are ignored (a newer server). Raises KeyError, TypeError or
        ValueError on a body that is not a batch."""
        return cls(model=str(d["model"]), mode=str(d["mode"]), alive=bool(d["alive"]),
                   active=int(d["active"]), waiting=int(d["waiting"]),
                   iterations=int(d["iterations"]),
                   recent=tuple(IterationView.from_dict(r) for r in d.get("recent", ())),
                   sessions=tuple(ServedSession.from_dict(s) for s in d.get("sessions", ())),
                   prompt_cache=(PromptCacheView(**{k: int(d["prompt_cache"][k]) for k in
                                                    PromptCacheView.__dataclass_fields__})
                                 if d.get("prompt_cache") else None))


@dataclass(frozen=True, slots=True)
class ServeView:
    """One watched server as the dashboard saw it: its batch, or why there is none."""

    url: str
    batch: BatchView | None = None
    error: str = ""  # why batch is None: connection refused, timed out, HTTP 401 ...

    @property
    def state(self) -> str:
        """``up``; ``no verifier`` (answers, cannot generate); ``down`` (no batch read)."""
        if self.batch is None:
            return "down"
        return "up" if self.batch.alive else "no verifier"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServeView:
        b = d.get("batch")
        return cls(url=str(d["url"]), batch=None if b is None else BatchView.from_dict(b),
                   error=str(d.get("error", "")))
