"""Soak: many short generations against a real local fleet; no failure, no growth, no leak.

After a warm-up (caches, allocator pools, lazily built sockets), each agent's VmRSS and open fd
count are read from /proc; after N more requests they are read again. Growth in RSS beyond a few
percent, or any fd growth, points at a leak per request (a socket per RemoteProposer not
closed, sessions not evicted, per-request state kept).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import GenerateDone
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen

DEFAULT_REQUESTS = 1000
DEFAULT_WARMUP = 20
DEFAULT_MAX_TOKENS = 4
MAX_RSS_GROWTH = 0.05
SETTLE_S = 2.0
PROMPTS = ("hi", "the cat sat", "1 2 3 4", "write a haiku", "hello there, friend")


def proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _sample(agents: list[local.LocalAgent]) -> dict[str, dict[str, int]]:
    return {a.name: {"rss": proc_rss(a.pid), "fds": proc_fds(a.pid)} for a in agents}


def soak(*, model: str, requests: int = DEFAULT_REQUESTS, warmup: int = DEFAULT_WARMUP,
         max_tokens: int = DEFAULT_MAX_TOKENS, spec: str = "ngram",
         progress: Callable[[str], None] = lambda m: None) -> dict:
    with tempfile.TemporaryDirectory(prefix="macfleet-soak-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        run_dir = Path(tmp) / "run"
        progress(f"starting a 2-agent fleet ({model})")
        cards = local.up(2, model=model, key=key, key_path=key_path, run_dir=run_dir)
        try:
            agents = local.read_state(run_dir)
            v = next(c for c in cards if ROLE_VERIFIER in c.roles)
            prop = [c.router_endpoint for c in cards if ROLE_PROPOSER in c.roles]
            failures: list[str] = []
            lat: list[float] = []

            def one(i: int) -> None:
                # alternate: 3 of 4 with the remote proposer, 1 the verifier alone
                use = prop if i % 4 else []
                t = time.perf_counter()
                try:
                    done = [m for m in generate_remote(
                        v, key, prompt=PROMPTS[i % len(PROMPTS)], chat=False,
                        max_tokens=max_tokens, proposers=use,
                        proposer_spec=spec if use else "none", first_token_timeout_s=30)
                        if isinstance(m, GenerateDone)]
                    if len(done) != 1 or not done[0].token_ids:
                        failures.append(f"request {i}: no GenerateDone with tokens")
                    elif use and done[0].stats.fleet and done[0].stats.fleet.proposer_failures:
                        failures.append(f"request {i}: proposer failed: {done[0].stats}")
                except (ProtocolError, TransportTimeout, PeerUnavailable) as e:
                    failures.append(f"request {i}: {type(e).__name__}: {e}")
                lat.append(time.perf_counter() - t)

            for i in range(warmup):
                one(i)
            before = _sample(agents)
            t0 = time.perf_counter()
            lat.clear()
            for i in range(requests):
                one(warmup + i)
                if (i + 1) % 100 == 0:
                    progress(f"{i + 1}/{requests} requests, {len(failures)} failures")
            wall = time.perf_counter() - t0
            time.sleep(SETTLE_S)  # ZeroMQ's reaper closes a dropped socket's fds asynchronously
            after = _sample(agents)
        finally:
            local.down(run_dir)
    per_agent = {}
    for name in before:
        b, a = before[name], after[name]
        per_agent[name] = {"rss_before": b["rss"], "rss_after": a["rss"],
                           "rss_growth": (a["rss"] - b["rss"]) / b["rss"] if b["rss"] else 0.0,
                           "fds_before": b["fds"], "fds_after": a["fds"]}
    lat.sort()
    ok = (not failures and all(x["rss_growth"] < MAX_RSS_GROWTH and x["fds_after"] <= x["fds_before"]
                               for x in per_agent.values()))
    return {"model": model, "requests": requests, "warmup": warmup, "max_tokens": max_tokens,
            "proposer_spec": spec, "wall_s": round(wall, 2),
            "requests_per_s": round(requests / wall, 2) if wall else 0.0,
            "latency_p50_ms": round(lat[len(lat) // 2] * 1e3, 1) if lat else None,
            "latency_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 1)
            if lat else None,
            "failures": len(failures), "failure_samples": failures[:10], "agents": per_agent,
            "max_rss_growth": MAX_RSS_GROWTH, "pass": ok}
