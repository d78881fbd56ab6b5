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

BATCH_PATH = "/v1/macfleet/batch"
# a session's life on the server: waiting for a slot, feeding its prompt, decoding, then gone
SESSION_STATES = ("queued", "prefill", "decode", "done", "cancelled", "failed")
ENGINE_MODES = ("batched", "fleet")  # one flat forward per iteration here | each request on
# a verifier agent (not batched)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (the rule bench serve uses); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True, slots=True)
class IterationView:
    """One forward over the flat batch: who was in it and how many tokens of each kind."""

    t: float  # the engine's clock (s): only differences between iterations mean anything
    sessions: int
    decode_tokens: int  # speculative blocks (1 + drafts each)
    prefill_tokens: int  # prompt chunks
    queued: int  # sessions waiting for a slot when it ran
    ms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IterationView:
        return cls(t=float(d["t"]), sessions=int(d["sessions"]),
                   decode_tokens=int(d["decode_tokens"]), prefill_tokens=int(d["prefill_tokens"]),
                   queued=int(d["queued"]), ms=float(d["ms"]))


@dataclass(frozen=True, slots=True)
class ServedSession:
    """One request's session: progress, time to first token and inter-token latency.

    Latencies are what the client sees: TTFT from the moment the request was queued, and the
    gaps between committed blocks (a block can carry several tokens), as bench serve measures
    them between streamed chunks."""

    sid: int
    state: str  # one of SESSION_STATES
    prompt_tokens: int
    prefill_left: int
    generated: int
    ttft_ms: float | None  # None: no token yet
    itl_p50_ms: float | None  # None: fewer than two blocks
    itl_p99_ms: float | None
    accepted: int
    drafted: int

    @property
    def active(self) -> bool:
        return self.state in ("queued", "prefill", "decode")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServedSession:
        return cls(sid=int(d["sid"]), state=str(d["state"]),
                   prompt_tokens=int(d["prompt_tokens"]), prefill_left=int(d["prefill_left"]),
                   generated=int(d["generated"]), ttft_ms=_opt_float(d.get("ttft_ms")),
                   itl_p50_ms=_opt_float(d.get("itl_p50_ms")),
                   itl_p99_ms=_opt_float(d.get("itl_p99_ms")),
                   accepted=int(d["accepted"]), drafted=int(d["drafted"]))


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
                   sessions=tuple(ServedSession.from_dict(s) for s in d.get("sessions", ())))


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
