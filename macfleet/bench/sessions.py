"""`macfleet bench sessions`: one proposer agent serving N verifier sessions at once (1 : N).

N verifier agents and one proposer agent run as local processes. Each verifier gets its own
prompt; every generation names the same proposer endpoint. First each session runs alone (one
after the other), then all N at once from N client threads released by a barrier. Reported:
aggregate tokens/s (all tokens / wall time of the whole concurrent round), per-session wall
time and tokens/s, and fairness (min/max of per-session tokens/s, Jain's index).

On a small machine the agents share the cores (5 processes on 2 cores here), so "at once"
measures time-slicing as much as the proposer's scheduling; say so when quoting it.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge.auth import fleet_id
from bridge.card import AgentCard
from bridge.discovery import LOOPBACK_ONLY, Browser
from bridge.messages import GenerateDone
from macfleet.bench.prompts import BENCH_PROMPTS, NO_MATCH_PROMPT
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen

DEFAULT_SESSIONS = 4
DEFAULT_MAX_TOKENS = 32
DEFAULT_SPEC = "layerskip:20"
DEFAULT_START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
DEFAULT_PROMPTS = (*BENCH_PROMPTS.values(), NO_MATCH_PROMPT)


@dataclass(frozen=True)
class SessionRun:
    session: int
    tokens: int
    wall_s: float  # request sent -> GenerateDone (prefill included)
    tokens_per_s: float  # tokens / wall_s
    decode_tokens_per_s: float  # from GenerateDone.stats (prefill excluded)
    acceptance: float
    start_s: float  # relative to the round's start
    end_s: float


@dataclass
class LocalFleet:
    """Agents started here (pids) and their discovered cards."""

    agents: list[local.LocalAgent]
    cards: dict[str, AgentCard]  # node_id -> card

    def card(self, a: local.LocalAgent) -> AgentCard:
        return self.cards[a.node_id]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        for a in self.agents:
            _signal(a.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for a in self.agents:
            while not _reaped(a.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _reaped(a.pid):
                _signal(a.pid, signal.SIGKILL)
                _reaped(a.pid)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return True


def start_fleet(roles: Sequence[str], *, model: str, key: bytes, key_path: Path, run_dir: Path,
                timeout_s: float = DEFAULT_START_TIMEOUT_S) -> LocalFleet:
    """Start one agent per role, unpinned (more agents than cores: let the OS share them),
    each with one BLAS thread; return once all are discovered."""
    run_dir.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    agents: list[local.LocalAgent] = []
    try:
        with Browser(fleet_id=fleet_id(key), interfaces=LOOPBACK_ONLY) as b:
            for i, role in enumerate(roles):
                agents.append(local.start_agent(role, name=f"{role}-{i}", model=model,
                                                key_path=key_path, run_dir=run_dir, cpu=None))
            fleet = LocalFleet(agents, {})
            want = {a.node_id for a in agents}
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                fleet.cards = {c.node_id: c for c in b.cards() if c.node_id in want}
                if len(fleet.cards) == len(want):
                    return fleet
                if any(_reaped(a.pid) for a in agents):
                    break
                time.sleep(0.2)
        fleet.stop()
        raise local.FleetStartError(f"agents not all up within {timeout_s:.0f}s; logs in {run_dir}")
    except BaseException:
        LocalFleet(agents, {}).stop()
        raise
    finally:
        if old is None:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = old


def run_session(i: int, verifier: AgentCard, key: bytes, prompt: str, n: int,
                proposers: list[str], spec: str, t0: float) -> SessionRun:
    start = time.perf_counter()
    done = None
    for msg in generate_remote(verifier, key, prompt=prompt, max_tokens=n, proposers=proposers,
                               proposer_spec=spec if proposers else "none"):
        if isinstance(msg, GenerateDone):
            done = msg
    end = time.perf_counter()
    if done is None:
        raise RuntimeError(f"session {i}: no GenerateDone")
    wall = end - start
    return SessionRun(session=i, tokens=len(done.token_ids), wall_s=round(wall, 4),
                      tokens_per_s=round(len(done.token_ids) / wall, 3),
                      decode_tokens_per_s=round(done.stats.decode_tokens_per_s, 3),
                      acceptance=round(done.stats.acceptance, 4),
                      start_s=round(start - t0, 4), end_s=round(end - t0, 4))


def concurrent_round(verifiers: Sequence[AgentCard], key: bytes, prompts: Sequence[str], n: int,
                     proposers: list[str], spec: str) -> list[SessionRun]:
    """All sessions at once: one client thread per verifier, released together."""
    barrier = threading.Barrier(len(verifiers) + 1)
    out: list[SessionRun | BaseException | None] = [None] * len(verifiers)
    t0 = [0.0]

    def worker(i: int) -> None:
        barrier.wait()
        try:
            out[i] = run_session(i, verifiers[i], key, prompts[i], n, proposers, spec, t0[0])
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread below
            out[i] = e

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(len(verifiers))]
    for t in threads:
        t.start()
    t0[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out  # type: ignore[return-value]


def fairness(tps: Sequence[float]) -> dict:
    """min/max ratio and Jain's index (1 = perfectly fair, 1/n = one session takes all)."""
    if not tps:
        return {}
    jain = sum(tps) ** 2 / (len(tps) * sum(t * t for t in tps)) if any(tps) else 0.0
    return {"min_tokens_per_s": round(min(tps), 3), "max_tokens_per_s": round(max(tps), 3),
            "min_over_max": round(min(tps) / max(tps), 3) if max(tps) else 0.0,
            "jain_index": round(jain, 4)}


def bench_sessions(*, model: str = "smollm2", sessions: int = DEFAULT_SESSIONS,
                   max_tokens: int = DEFAULT_MAX_TOKENS, spec: str = DEFAULT_SPEC,
                   prompts: Sequence[str] = DEFAULT_PROMPTS,
                   progress: Callable[[str], None] = lambda m: None) -> dict:
    prompts = [prompts[i % len(prompts)] for i in range(sessions)]
    with tempfile.TemporaryDirectory(prefix="macfleet-sessions-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        progress(f"starting 1 proposer + {sessions} verifiers ({model})")
        fleet = start_fleet(["proposer"] + ["verifier"] * sessions, model=model, key=key,
                            key_path=key_path, run_dir=Path(tmp) / "run")
        try:
            prop = [fleet.card(fleet.agents[0]).router_endpoint]
            vs = [fleet.card(a) for a in fleet.agents[1:]]
            for i, v in enumerate(vs):  # warm-up: model pages, sockets, proposer sessions
                run_session(i, v, key, "Hi", 4, prop, spec, time.perf_counter())
            alone = []
            for i, v in enumerate(vs):
                alone.append(run_session(i, v, key, prompts[i], max_tokens, prop, spec,
                                         time.perf_counter()))
                progress(f"alone   session {i}: {alone[-1].tokens} tok in {alone[-1].wall_s:.2f}s"
                         f" ({alone[-1].tokens_per_s:.1f} tok/s)")
            together = concurrent_round(vs, key, prompts, max_tokens, prop, spec)
            for r in together:
                progress(f"at once session {r.session}: {r.tokens} tok in {r.wall_s:.2f}s "
                         f"({r.tokens_per_s:.1f} tok/s)")
        finally:
            fleet.stop()
    span = max(r.end_s for r in together) - min(r.start_s for r in together)
    agg = sum(r.tokens for r in together) / span
    alone_sum_s = sum(r.wall_s for r in alone)
    return {
        "model": model, "proposer_spec": spec, "sessions": sessions, "max_tokens": max_tokens,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "processes": sessions + 1,
        "alone": [asdict(r) for r in alone],
        "concurrent": [asdict(r) for r in together],
        "aggregate": {
            "concurrent_tokens_per_s": round(agg, 3),
            "concurrent_wall_s": round(span, 4),
            "sequential_tokens_per_s": round(sum(r.tokens for r in alone) / alone_sum_s, 3),
            "sequential_wall_s": round(alone_sum_s, 4),
            "speedup_vs_sequential": round(agg / (sum(r.tokens for r in alone) / alone_sum_s), 3),
        },
        "fairness_concurrent": fairness([r.tokens_per_s for r in together]),
        "slowdown_per_session": [round(a.tokens_per_s / c.tokens_per_s, 3)
                                 for a, c in zip(alone, together)],
        "notes": f"{sessions + 1} agent processes (unpinned, 1 BLAS thread each) share "
                 f"{os.cpu_count()} cores on this machine, so concurrency is bounded by CPU "
                 "time-slicing, not by the proposer's scheduling alone; on separate Macs each "
                 "verifier would have its own GPU. tokens_per_s = tokens / wall (prefill "
                 "included); decode_tokens_per_s excludes prefill.",
    }
