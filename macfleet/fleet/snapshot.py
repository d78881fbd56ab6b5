"""Frozen views of the fleet at one instant, and the sources that deliver them.

The dashboard (``tui``) and anything that records or replays a fleet only ever see these
types: they are pure data (no Textual, zmq or MLX), so they can be built in tests, written
to JSON lines and replayed without a fleet.  The live observer in ``macfleet.fleet`` turns
discovered agents and their metrics stream into one ``FleetSnapshot`` per refresh.
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from macfleet.fleet.batch import ServeView

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FLOW_NAMES = ("F1", "F2", "F3", "shard", "KV")  # KV: once per prompt, not per block
EVENT_KINDS = ("join", "leave", "heartbeat_lost", "heartbeat_back", "error", "session")


class SnapshotFormatError(ValueError):
    """A recorded snapshot (dict or JSON line) that cannot be decoded."""


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _strs(v: Iterable[Any]) -> tuple[str, ...]:
    if isinstance(v, str):  # a bare string would silently become a tuple of letters
        raise TypeError(f"expected a list of strings, got {v!r}")
    return tuple(str(x) for x in v)


class _Dictable:
    """``to_dict`` shared by every view: plain JSON-ready values, tuples kept as tuples."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class HostView(_Dictable):
    """One agent as the observer sees it; ``rtt_ms`` is measured from the observing host."""

    node_id: str
    name: str
    chip: str
    roles: tuple[str, ...]
    models: tuple[str, ...]
    mem_used: int
    mem_total: int
    load: float
    heartbeat_age_s: float | None
    rtt_ms: float | None
    alive: bool
    address: str

    @property
    def mem_fraction(self) -> float:
        return self.mem_used / self.mem_total if self.mem_total > 0 else 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostView:
        return cls(
            node_id=str(d["node_id"]), name=str(d["name"]), chip=str(d["chip"]),
            roles=_strs(d["roles"]), models=_strs(d["models"]),
            mem_used=int(d["mem_used"]), mem_total=int(d["mem_total"]), load=float(d["load"]),
            heartbeat_age_s=_opt_float(d.get("heartbeat_age_s")),
            rtt_ms=_opt_float(d.get("rtt_ms")), alive=bool(d["alive"]),
            address=str(d.get("address", "")),
        )


@dataclass(frozen=True, slots=True)
class LinkView(_Dictable):
    """Round-trip latency between two hosts, by node name."""

    src: str
    dst: str
    rtt_p50_ms: float | None
    rtt_p95_ms: float | None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkView:
        return cls(src=str(d["src"]), dst=str(d["dst"]),
                   rtt_p50_ms=_opt_float(d.get("rtt_p50_ms")),
                   rtt_p95_ms=_opt_float(d.get("rtt_p95_ms")))


@dataclass(frozen=True, slots=True)
class FlowView(_Dictable):
    """What one inter-host flow (docs/design.md F1/F2/F3/shard) costs per block.

    ``probe`` marks a flow measured by ``bench`` with real payload sizes although no
    drafter uses it (F3 without an EAGLE-style drafter); ``estimate`` one not measured at all:
    F3's cost computed from the verifier's hidden width and the link's measured time per byte
    (the rule real F3 is accounted by: a round trip's wire time split by bytes); ``history``
    holds recent
    ``ms_per_block`` samples for a sparkline.
    """

    flow: str
    bytes_per_block: float
    ms_per_block: float
    share_of_block: float
    probe: bool = False
    history: tuple[float, ...] = ()
    # not measured: what the flow would cost (F3 with no F3 drafter), or priced from a
    # measured latency (a shard group's collectives, which run inside the forward's graph)
    estimate: bool = False

    @property
    def label(self) -> str:
        return f"{self.flow} est" if self.estimate else (
            f"{self.flow} probe" if self.probe else self.flow)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FlowView:
        return cls(flow=str(d["flow"]), bytes_per_block=float(d["bytes_per_block"]),
                   ms_per_block=float(d["ms_per_block"]),
                   share_of_block=float(d["share_of_block"]), probe=bool(d.get("probe", False)),
                   history=tuple(float(x) for x in d.get("history", ())),
                   estimate=bool(d.get("estimate", False)))


@dataclass(frozen=True, slots=True)
class BlockSample(_Dictable):
    """Timing of one speculative block: drafted ``k``, ``accepted`` of them."""

    block: int
    k: int
    accepted: int
    block_ms: float
    draft_ms: float
    verify_ms: float
    wire_ms: float

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockSample:
        return cls(block=int(d["block"]), k=int(d["k"]), accepted=int(d["accepted"]),
                   block_ms=float(d["block_ms"]), draft_ms=float(d["draft_ms"]),
                   verify_ms=float(d["verify_ms"]), wire_ms=float(d["wire_ms"]))


@dataclass(frozen=True, slots=True)
class DrafterShare(_Dictable):
    """`--proposer auto` (issue 44): the blocks of a session one candidate drafted (plain
    decoding, `none`, is one), of which `explored` were tries rather than its best guess."""

    name: str
    blocks: int
    explored: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DrafterShare:
        return cls(name=str(d["name"]), blocks=int(d["blocks"]),
                   explored=int(d.get("explored", 0)))


@dataclass(frozen=True, slots=True)
class SessionView(_Dictable):
    """One decoding session; ``accepted_hist[i]`` counts blocks that accepted ``i`` tokens."""

    session_id: str
    verifier: str
    proposers: tuple[str, ...]
    topology: str
    tokens_per_s: float
    acceptance: float
    mean_accepted: float
    draft_len: int
    blocks: int
    accepted_hist: tuple[int, ...]
    flows: tuple[FlowView, ...]
    timeline: tuple[BlockSample, ...]
    overhead_share: float
    active: bool
    # an expert-parallel verifier: tokens its router sent to each rank's experts (the window)
    rank_load: tuple[int, ...] = ()
    # drafted ahead by a draft-model agent: its mean lead (drafts waiting when a block began)
    # and the share of its drafts thrown away; None without one
    ahead: tuple[float, float] | None = None
    # `--proposer auto`: the candidate that drafted the latest block and why
    # (stats.CHOICE_REASONS), and every candidate's blocks so far, most first; "" and ()
    # for a fixed drafter
    drafter: str = ""
    why: str = ""
    drafters: tuple[DrafterShare, ...] = ()

    def flow(self, name: str) -> FlowView | None:
        return next((f for f in self.flows if f.flow == name), None)

    def drafter_share(self, name: str) -> float:
        """The share of the session's chosen blocks `name` drafted (0 if none)."""
        total = sum(d.blocks for d in self.drafters)
        return next((d.blocks for d in self.drafters if d.name == name), 0) / total \
            if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.rank_load:  # recordings without a MoE verifier stay as they were
            del d["rank_load"]
        if self.ahead is None:  # ... and without a draft-model agent
            del d["ahead"]
        if not self.drafters:  # ... and without `auto`
            del d["drafter"], d["why"], d["drafters"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SessionView:
        return cls(
            session_id=str(d["session_id"]), verifier=str(d["verifier"]),
            proposers=_strs(d["proposers"]), topology=str(d["topology"]),
            tokens_per_s=float(d["tokens_per_s"]), acceptance=float(d["acceptance"]),
            mean_accepted=float(d["mean_accepted"]), draft_len=int(d["draft_len"]),
            blocks=int(d["blocks"]), accepted_hist=tuple(int(x) for x in d["accepted_hist"]),
            flows=tuple(FlowView.from_dict(f) for f in d.get("flows", ())),
            timeline=tuple(BlockSample.from_dict(b) for b in d.get("timeline", ())),
            overhead_share=float(d["overhead_share"]), active=bool(d["active"]),
            rank_load=tuple(int(x) for x in d.get("rank_load", ())),
            ahead=(float(d["ahead"][0]), float(d["ahead"][1])) if d.get("ahead") else None,
            drafter=str(d.get("drafter", "")), why=str(d.get("why", "")),
            drafters=tuple(DrafterShare.from_dict(x) for x in d.get("drafters", ())),
        )


@dataclass(frozen=True, slots=True)
class FleetEvent(_Dictable):
    """Something that happened in the fleet (``kind`` is one of ``EVENT_KINDS``).

    Snapshots carry a window of recent events, so the same event may appear in several
    consecutive snapshots; consumers de-duplicate on the whole value.
    """

    t: float
    kind: str
    text: str

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FleetEvent:
        return cls(t=float(d["t"]), kind=str(d["kind"]), text=str(d["text"]))


@dataclass(frozen=True, slots=True)
class FleetSnapshot(_Dictable):
    """Everything the dashboard shows, taken at ``taken_at`` (Unix seconds); ``serve`` is the
    watched `macfleet serve` (``dash --serve``), None when none is watched."""

    taken_at: float
    fleet_id: str
    hosts: tuple[HostView, ...] = ()
    links: tuple[LinkView, ...] = ()
    sessions: tuple[SessionView, ...] = ()
    events: tuple[FleetEvent, ...] = ()
    serve: ServeView | None = None

    @classmethod
    def empty(cls, fleet_id: str = "", taken_at: float = 0.0) -> FleetSnapshot:
        """A fleet with nothing discovered yet (what the dashboard starts from)."""
        return cls(taken_at=taken_at, fleet_id=fleet_id)

    def to_dict(self) -> dict[str, Any]:
        d = {"v": FORMAT_VERSION, **asdict(self)}
        if self.serve is None:  # recordings of a fleet alone stay as they were
            del d["serve"]
        d["sessions"] = [s.to_dict() for s in self.sessions]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FleetSnapshot:
        """Decode a dict from ``to_dict``/JSON; unknown keys are ignored (forward compatible)."""
        try:
            version = int(d.get("v", FORMAT_VERSION))
            if version > FORMAT_VERSION:
                raise SnapshotFormatError(f"snapshot format v{version} is newer than "
                                          f"v{FORMAT_VERSION}; upgrade macfleet")
            return cls(
                taken_at=float(d["taken_at"]), fleet_id=str(d["fleet_id"]),
                hosts=tuple(HostView.from_dict(h) for h in d.get("hosts", ())),
                links=tuple(LinkView.from_dict(x) for x in d.get("links", ())),
                sessions=tuple(SessionView.from_dict(s) for s in d.get("sessions", ())),
                events=tuple(FleetEvent.from_dict(e) for e in d.get("events", ())),
                serve=ServeView.from_dict(d["serve"]) if d.get("serve") else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, SnapshotFormatError):
                raise
            raise SnapshotFormatError(f"bad fleet snapshot: {exc!r}") from exc

    def to_json(self) -> str:
        """One line of a JSON-lines recording."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> FleetSnapshot:
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SnapshotFormatError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise SnapshotFormatError("a snapshot line must hold a JSON object")
        return cls.from_dict(data)


EMPTY_SNAPSHOT = FleetSnapshot.empty()


def write_jsonl(path: str | Path, snapshots: Iterable[FleetSnapshot]) -> int:
    """Write a recording, one snapshot per line; returns how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for snap in snapshots:
            fh.write(snap.to_json() + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[FleetSnapshot]:
    """Read a recording, skipping (and logging) blank or undecodable lines."""
    out: list[FleetSnapshot] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(FleetSnapshot.from_json(line))
            except SnapshotFormatError as exc:
                log.warning("%s:%d: skipped: %s", path, lineno, exc)
    return out


class SnapshotSource(ABC):
    """Where a dashboard gets snapshots from: live observer, recording, or a test list.

    ``poll`` runs on a worker thread and blocks at most ``timeout_s``; it returns the newest
    snapshot since the previous call (sources coalesce, the dashboard only wants the latest)
    or ``None`` when nothing new arrived.  ``close`` is idempotent and may be called from
    another thread; a ``poll`` blocked at that moment must return ``None`` promptly.
    """

    @abstractmethod
    def poll(self, timeout_s: float) -> FleetSnapshot | None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> SnapshotSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StaticSource(SnapshotSource):
    """Hands out given snapshots one per poll, then ``None``; tests ``push`` more later."""

    def __init__(self, snapshots: Iterable[FleetSnapshot] = ()) -> None:
        self._queue: deque[FleetSnapshot] = deque(snapshots)
        self._cond = threading.Condition()
        self._closed = False
        self.polls = 0

    def push(self, snapshot: FleetSnapshot) -> None:
        with self._cond:
            self._queue.append(snapshot)
            self._cond.notify_all()

    def poll(self, timeout_s: float) -> FleetSnapshot | None:
        with self._cond:
            self.polls += 1
            self._cond.wait_for(lambda: self._queue or self._closed, timeout=timeout_s)
            if self._closed or not self._queue:
                return None
            return self._queue.popleft()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ReplaySource(SnapshotSource):
    """Plays a JSON-lines recording, one snapshot per poll; ``loop`` restarts at the end.

    The file is read up front so a missing path fails at construction, in the CLI, not in
    the dashboard's worker.  Once played out (and not looping) it stalls like a dead stream.
    """

    def __init__(self, path: str | Path, *, loop: bool = False) -> None:
        self.path = Path(path)
        self.snapshots = read_jsonl(self.path)
        self.loop = loop
        self._next = 0
        self._closed = threading.Event()

    def poll(self, timeout_s: float) -> FleetSnapshot | None:
        if self._closed.is_set():
            return None
        if self._next >= len(self.snapshots) and self.loop and self.snapshots:
            self._next = 0
        if self._next < len(self.snapshots):
            self._next += 1
            return self.snapshots[self._next - 1]
        self._closed.wait(timeout_s)
        return None

    def close(self) -> None:
        self._closed.set()


class RecordingSource(SnapshotSource):
    """Wraps another source and appends every snapshot it yields to a JSON-lines file."""

    def __init__(self, inner: SnapshotSource, path: str | Path) -> None:
        self.inner = inner
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._lock = threading.Lock()

    def poll(self, timeout_s: float) -> FleetSnapshot | None:
        snap = self.inner.poll(timeout_s)
        if snap is not None:
            with self._lock:
                if not self._fh.closed:
                    self._fh.write(snap.to_json() + "\n")
                    self._fh.flush()
        return snap

    def close(self) -> None:
        self.inner.close()
        with self._lock:
            self._fh.close()
