"""`bench disagg`'s agents: a verifier and prefill agents, each pinned to a core, on a link:
`loopback` (every agent on 127.0.0.1) or `netns-wifi` (each agent in a network namespace of the
test bed, tests/testbed/netns.py, behind a 100 Mbit/s Wi-Fi-like link; needs root and a source
checkout)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bridge.auth import fleet_id
from bridge.discovery import LOOPBACK_ONLY, Browser
from macfleet.bench.sessions import DEFAULT_START_TIMEOUT_S, LocalFleet, _reaped
from macfleet.fleet import local


def start_pinned(agents: list[tuple[str, int | None, list[str]]], *, model: str, key: bytes,
                 key_path: Path, run_dir: Path) -> LocalFleet:
    """One agent per (role, core, extra args); return once all are discovered."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started: list[local.LocalAgent] = []
    try:
        with Browser(fleet_id=fleet_id(key), interfaces=LOOPBACK_ONLY) as b:
            for i, (role, cpu, extra) in enumerate(agents):
                started.append(local.start_agent(role, name=f"{role}-{i}", model=model,
                                                 key_path=key_path, run_dir=run_dir, cpu=cpu,
                                                 extra=extra))
            fleet = LocalFleet(started, {})
            want = {a.node_id for a in started}
            deadline = time.monotonic() + DEFAULT_START_TIMEOUT_S
            while time.monotonic() < deadline:
                fleet.cards = {c.node_id: c for c in b.cards() if c.node_id in want}
                if len(fleet.cards) == len(want):
                    time.sleep(1.0)  # the verifier's own browser sees the prefill agent too
                    return fleet
                if any(_reaped(a.pid) for a in started):
                    break
                time.sleep(0.2)
        raise local.FleetStartError(f"agents not all up; logs in {run_dir}")
    except BaseException:
        LocalFleet(started, {}).stop()
        raise


LINKS = ("loopback", "netns-wifi")
ROOT_HOST = 254  # this process's address on the test bed's bridge: <subnet>.254


@contextlib.contextmanager
def agents_up(link: str, agents: list[tuple[str, int | None, list[str]]], *, model: str,
              key: bytes, key_path: Path, run_dir: Path) -> Iterator:
    """The agents (role, core, extra args) on `link`; yields their cards, in order (the first:
    the verifier's), once every agent is discovered; stops them all on exit."""
    if link == "loopback":
        fleet = start_pinned(agents, model=model, key=key, key_path=key_path, run_dir=run_dir)
        try:
            yield [fleet.card(a) for a in fleet.agents]
        finally:
            fleet.stop()
        return
    if link != "netns-wifi":
        raise ValueError(f"unknown link {link!r} (one of {', '.join(LINKS)})")
    from macfleet.bench.f3 import load_testbed

    netns, why = load_testbed()
    if why:
        raise RuntimeError(f"netns-wifi: {why}")
    run_dir.mkdir(parents=True, exist_ok=True)
    with netns.Testbed(len(agents), rate=netns.WIFI_RATE) as tb:
        root_ip = tb.join_root(ROOT_HOST)
        names = []
        for i, (host, (role, cpu, extra)) in enumerate(zip(tb.hosts, agents)):
            names.append(f"{role}-{i}")
            cmd = [sys.executable, "-m", "macfleet", "agent", "--role", role, "--model", model,
                   "--name", names[-1], "--bind", host.ip, "--key", str(key_path),
                   *(["--cpu", str(cpu)] if cpu is not None else []), *extra]
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1") if cpu is not None else None
            with open(run_dir / f"{names[-1]}.log", "ab") as log:
                tb.popen(host, cmd, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, env=env)
        with Browser(fleet_id=fleet_id(key), interfaces=[root_ip]) as b:
            deadline = time.monotonic() + DEFAULT_START_TIMEOUT_S
            while time.monotonic() < deadline:
                cards = {c.name: c for c in b.cards() if c.name in names}
                if len(cards) == len(names):
                    break
                time.sleep(0.2)
            else:
                raise local.FleetStartError(f"netns agents not all up; logs in {run_dir}")
        time.sleep(1.0)  # the verifier's own browser sees the prefill agent too
        yield [cards[n] for n in names]
