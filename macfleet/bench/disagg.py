"""`macfleet bench disagg`: short sessions around a long prompt, with and without a prefill agent.

A verifier agent (pinned to one core) serves a stream of short chat sessions; while the first
decodes, a long prompt arrives, and more short sessions follow. The verifier serves requests
one at a time, so without a prefill agent every session queued behind the long prompt waits
for its whole prefill. With a prefill agent (pinned to the other core) the verifier's prefill
stage fetches the long prompt's KV while the short sessions keep being served, and decodes the
long prompt from the shipped cache. Reported per mode: each short session's time to first token
(queueing included) and inter-token gaps (p50/p99), the long prompt's time to first token, the
KV flow (bytes, ms, the planner's reason), and whether the long prompt's greedy ids equal the
verifier-alone ones. Loopback only: the planner's link speed is what loopback measures.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge.auth import fleet_id
from bridge.discovery import LOOPBACK_ONLY, Browser
from bridge.messages import GenerateChunk, GenerateDone
from macfleet.bench.prompts import BENCH_PROMPTS
from macfleet.bench.record import median
from macfleet.bench.sessions import DEFAULT_START_TIMEOUT_S, LocalFleet, _reaped
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen

DEFAULT_PROMPT_TOKENS = 2000
DEFAULT_SHORT_SESSIONS = 4
DEFAULT_SHORT_TOKENS = 32
DEFAULT_LONG_TOKENS = 16
LONG_AFTER_S = 0.5  # the long prompt arrives while the first short session decodes
SHORT_EVERY_S = 1.0  # the other short sessions follow at this period
# a verifier busy with a long prefill on a loaded core can miss its 1 s heartbeats for longer
# than a client's default 3 s silence deadline; here it is a measurement, not a liveness check
SILENCE_S = 120.0
PARAGRAPH = ("The history of computing is a history of moving data closer to where it is used. "
             "Early machines stored programs on punched cards and paper tape; later ones kept "
             "them in magnetic core memory, then in semiconductor memory whose speed grew far "
             "faster than the speed of the wires between chips. Every generation of hardware "
             "since has added a layer of cache to hide that gap, and every generation of "
             "software has learned to batch its work so that each byte fetched is used many "
             "times before it is evicted. ")


@dataclass(frozen=True)
class Timed:
    """One request as its client saw it."""

    name: str
    submit_s: float  # relative to the round's start
    ttft_s: float  # submit -> first token
    gaps_s: tuple[float, ...]  # between token-carrying chunks
    tokens: int
    token_ids: tuple[int, ...]
    kv: dict


def long_prompt(tokenizer, n: int) -> str:
    """Text of n tokens (the chat template adds a few)."""
    text = PARAGRAPH
    while len(tokenizer.encode(text)) < n:
        text += PARAGRAPH
    ids = tokenizer.encode(text)[:n]
    return tokenizer.decode(ids)


def run_one(name: str, card, key: bytes, prompt: str, n: int, t0: float) -> Timed:
    submit = time.perf_counter()
    stamps: list[float] = []
    done = None
    for msg in generate_remote(card, key, prompt=prompt, chat=True, max_tokens=n,
                               proposer_spec="ngram", first_token_timeout_s=600.0,
                               silence_s=SILENCE_S):
        if isinstance(msg, GenerateChunk) and msg.token_ids:
            stamps.append(time.perf_counter())
        elif isinstance(msg, GenerateDone):
            done = msg
    if done is None:
        raise RuntimeError(f"{name}: no GenerateDone")
    stamps = stamps or [time.perf_counter()]  # no token before the end (an immediate stop)
    kv = done.stats.fleet.kv if done.stats.fleet else None
    return Timed(name, round(submit - t0, 3), round(stamps[0] - submit, 4),
                 tuple(round(b - a, 4) for a, b in zip(stamps, stamps[1:])),
                 len(done.token_ids), tuple(done.token_ids), asdict(kv) if kv else {})


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


def scenario(card, key: bytes, long_text: str, *, shorts: int, short_tokens: int,
             long_tokens: int) -> list[Timed]:
    """Short session 1 at 0, the long prompt at LONG_AFTER_S, the others every SHORT_EVERY_S."""
    prompts = list(BENCH_PROMPTS.values())
    plan = [("short-1", 0.0, prompts[0], short_tokens),
            ("long", LONG_AFTER_S, long_text, long_tokens)]
    plan += [(f"short-{i + 1}", i * SHORT_EVERY_S, prompts[i % len(prompts)], short_tokens)
             for i in range(1, shorts)]
    out: dict[str, Timed | BaseException] = {}
    t0 = time.perf_counter()

    def worker(name: str, at: float, prompt: str, n: int) -> None:
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        try:
            out[name] = run_one(name, card, key, prompt, n, t0)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            out[name] = e

    threads = [threading.Thread(target=worker, args=p, daemon=True) for p in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out.values():
        if isinstance(r, BaseException):
            raise r
    return [out[p[0]] for p in plan]  # type: ignore[misc]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarize(runs: list[Timed]) -> dict:
    shorts = [r for r in runs if r.name.startswith("short")]
    long = next(r for r in runs if r.name == "long")
    gaps = [g for r in shorts for g in r.gaps_s]
    ttfts = [r.ttft_s for r in shorts]
    return {"short_ttft_s": {"p50": round(median(ttfts), 3), "max": round(max(ttfts), 3)},
            "short_itl_s": {"p50": round(pct(gaps, 0.5), 4), "p99": round(pct(gaps, 0.99), 4)},
            "long_ttft_s": long.ttft_s, "kv": long.kv,
            "requests": [asdict(r) | {"token_ids": None} for r in runs]}


def bench_disagg(*, model: str = "smollm2", prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                 shorts: int = DEFAULT_SHORT_SESSIONS, short_tokens: int = DEFAULT_SHORT_TOKENS,
                 long_tokens: int = DEFAULT_LONG_TOKENS, codecs: tuple[str, ...] = ("auto",),
                 progress: Callable[[str], None] = lambda m: None) -> dict:
    from macfleet.engine.models import load_model

    long_text = long_prompt(load_model(model).tokenizer, prompt_tokens)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    v_cpu, p_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    modes = [("verifier alone", None)] + [(f"prefill agent ({c})", c) for c in codecs]
    results, ids = [], {}
    for label, codec in modes:
        with tempfile.TemporaryDirectory(prefix="macfleet-disagg-") as tmp:
            key_path = Path(tmp) / "fleet.key"
            key = keygen(key_path)
            agents = [("verifier", v_cpu, ["--no-disagg"] if codec is None else
                       ["--kv-codec", codec])]
            if codec is not None:
                agents.append(("prefill", p_cpu, []))
            progress(f"{label}: starting {len(agents)} agent(s) ({model})")
            fleet = start_pinned(agents, model=model, key=key, key_path=key_path,
                                 run_dir=Path(tmp) / "run")
            try:
                card = fleet.card(fleet.agents[0])
                run_one("warm-up", card, key, "Hi", 4, time.perf_counter())
                progress(f"{label}: {shorts} short sessions, a {prompt_tokens}-token prompt")
                runs = scenario(card, key, long_text, shorts=shorts, short_tokens=short_tokens,
                                long_tokens=long_tokens)
            finally:
                fleet.stop()
        ids[label] = next(r.token_ids for r in runs if r.name == "long")
        results.append({"mode": label, "codec": codec, **summarize(runs)})
        progress(f"{label}: short TTFT max {results[-1]['short_ttft_s']['max']} s, long TTFT "
                 f"{results[-1]['long_ttft_s']} s")
    base = ids["verifier alone"]
    for r in results:
        r["long_ids_identical_to_verifier_alone"] = ids[r["mode"]] == base
    return {"model": model, "prompt_tokens": prompt_tokens, "short_sessions": shorts,
            "short_tokens": short_tokens, "long_tokens": long_tokens, "link": "loopback",
            "cores": {"verifier": v_cpu, "prefill": p_cpu}, "modes": results}
