"""A local fleet: agent processes on this machine (`macfleet up` / `macfleet down`).

Each agent is a real process (`python -m macfleet agent ...`) in its own session, with its
own log in the run directory; `fleet.json` there records their pids so `down` can stop them.
On Linux each agent is pinned to its own core when there are enough, so the proposer's
drafting and the verifier's verifying really run at the same time.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge.auth import fleet_id
from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER, AgentCard
from bridge.discovery import LOOPBACK_ONLY, Browser
from bridge.peers import signed

# agents advertise once warm (agents/warmup.py): a machine without a verify(L) table measures
# it first, a loaded one slowly
DEFAULT_START_TIMEOUT_S = 180.0
DEFAULT_STOP_TIMEOUT_S = 10.0
EXIT_WITH_PERIOD_S = 1.0  # how often a tied agent checks that its starter still runs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalAgent:
    name: str
    role: str
    node_id: str
    pid: int
    log: str


class FleetStartError(RuntimeError):
    pass


def _state_file(run_dir: Path) -> Path:
    return run_dir / "fleet.json"


def read_state(run_dir: Path) -> list[LocalAgent]:
    try:
        return [LocalAgent(**a) for a in json.loads(_state_file(run_dir).read_text())]
    except (OSError, ValueError, TypeError):
        return []


_children: dict[int, subprocess.Popen] = {}  # agents started by this process


def _alive(pid: int) -> bool:
    """True while the process runs. Our own children are polled: a dead child stays a zombie
    (and answers kill(pid, 0)) until it is reaped."""
    child = _children.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def plan_roles(agents: int) -> list[str]:
    if agents < 2:
        raise ValueError("a local fleet needs at least 2 agents (one verifier, one proposer)")
    return [ROLE_VERIFIER] + [ROLE_PROPOSER] * (agents - 1)


def start_agent(role: str, *, name: str, model: str, key_path: Path | None, run_dir: Path,
                cpu: int | None, extra: list[str] | None = None) -> LocalAgent:
    node_id = uuid.uuid4().hex[:12]
    log = run_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "macfleet", "agent", "--role", role, "--model", model,
           "--name", name, "--node-id", node_id, "--loopback"]
    cmd += ["--key", str(key_path)] if key_path else ["--open"]
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    cmd += extra or []
    env = dict(os.environ)
    if cpu is not None:  # one core: more BLAS threads than cores only contend
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    with open(log, "ab") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
    _children[p.pid] = p
    return LocalAgent(name, role, node_id, p.pid, str(log))


def up(agents: int = 2, *, model: str = "smollm2", key: bytes | None, key_path: Path | None,
       run_dir: Path, pin: bool = True, timeout_s: float = DEFAULT_START_TIMEOUT_S,
       extra_args: dict[str, list[str]] | None = None, shard: int = 0,
       shard_mode: str = "pipeline", prefill: int = 0, tied: bool = False) -> list[AgentCard]:
    """Start the agents and return their cards once all are discovered over Zeroconf: an agent
    advertises itself once it is warm (agents/warmup.py), so the fleet is ready then.

    tied: the agents stop when this process ends, however it ends (`macfleet demo`, tests: a
    run killed by a timeout leaves no fleet behind); `macfleet up` starts agents that outlive
    it, to be stopped by `macfleet down`.

    shard >= 2: the verifier is a group of `shard` shard agents (ranks of one sharded
    verifier, which form their mlx.distributed ring from each other's cards); rank 0 serves
    as the verifier once the group is up. prefill: also start that many prefill agents.
    """
    running = [a for a in read_state(run_dir) if _alive(a.pid)]
    if running:
        raise FleetStartError(f"a local fleet is already running ({len(running)} agents, "
                              f"{run_dir}); run `macfleet down` first")
    run_dir.mkdir(parents=True, exist_ok=True)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    started: list[LocalAgent] = []
    fid = fleet_id(key)
    with Browser(fleet_id=fid, interfaces=LOOPBACK_ONLY,
                 accept=lambda c: signed(c, key)) as browser:  # members' cards only
        roles = plan_roles(agents)
        if shard >= 2:
            group = uuid.uuid4().hex[:8]
            roles = [f"shard:{r}" for r in range(shard)] + roles[1:]
        roles += ["prefill"] * prefill
        for i, role in enumerate(roles):
            cpu = cpus[i % len(cpus)] if pin and cpus and (ncpu or 1) >= 2 else None
            extra = list((extra_args or {}).get(role.split(":")[0], []))
            if tied:
                extra += ["--exit-with", str(os.getpid())]
            if role.startswith("shard:"):
                extra += ["--group", group, "--group-size", str(shard), "--rank",
                          role.split(":")[1], "--shard-mode", shard_mode]
                role = "shard"
            started.append(start_agent(role, name=f"{role}-{i}", model=model, key_path=key_path,
                                       run_dir=run_dir, cpu=cpu, extra=extra))
        _state_file(run_dir).write_text(json.dumps([asdict(a) for a in started], indent=1))
        want = {a.node_id for a in started}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cards = [c for c in browser.cards() if c.node_id in want]
            if len(cards) == len(want) and any(ROLE_VERIFIER in c.roles for c in cards):
                return cards
            dead = [a for a in started if not _alive(a.pid)]
            if dead:
                down(run_dir)
                tail = Path(dead[0].log).read_text(errors="replace")[-2000:]
                raise FleetStartError(f"agent {dead[0].name} exited during start-up; its log "
                                      f"({dead[0].log}) ends with:\n{tail}")
            time.sleep(0.2)
    down(run_dir)
    raise FleetStartError(f"agents not discovered within {timeout_s:.0f}s; logs in {run_dir}")


def exit_with(pid: int, stop: Callable[[], None], period_s: float = EXIT_WITH_PERIOD_S
              ) -> threading.Thread:
    """Call `stop` once process `pid` has ended (checked every period_s, on a daemon thread):
    an agent tied to the process that started it (`macfleet agent --exit-with PID`)."""
    def watch() -> None:
        while _alive(pid):
            time.sleep(period_s)
        log.warning("process %d has ended: stopping", pid)
        stop()
    t = threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True)
    t.start()
    return t


def down(run_dir: Path, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int:
    """SIGTERM every agent of the local fleet (SIGKILL after timeout_s); returns how many."""
    agents = [a for a in read_state(run_dir) if _alive(a.pid)]
    for a in agents:
        try:
            os.kill(a.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for a in agents:
        while _alive(a.pid) and time.monotonic() < deadline:
            _reap(a.pid)
            time.sleep(0.05)
        if _alive(a.pid):
            os.kill(a.pid, signal.SIGKILL)
            _reap(a.pid)
    for a in agents:
        _children.pop(a.pid, None)
    try:
        _state_file(run_dir).unlink()
    except FileNotFoundError:
        pass
    return len(agents)


def _reap(pid: int) -> None:
    child = _children.get(pid)
    if child is not None:
        child.poll()
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
