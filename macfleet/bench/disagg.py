"""`macfleet bench disagg`: sessions decoding while a long prompt arrives, with and without a
prefill agent.

A verifier agent (pinned to one core) runs a continuous batch: a few short chat sessions
decode together; then a long prompt arrives. Without a prefill agent the verifier prefills it
itself, in chunks inside the batch (its stall control keeps an iteration within ~2x a decode
one). With a prefill agent (pinned to the other core) the verifier's prefill stage fetches the
long prompt's KV over flow KV while the batch keeps decoding, installs it in a batch row and
decodes it with the others. Reported per prompt size and mode: the short sessions' inter-token
gaps inside the window from the long prompt's arrival to its first token (p50, p99, max; the
goal: p99 <= 1.5x p50 with a prefill agent), the long prompt's time to first token, the KV flow
(bytes, ms), and whether its greedy ids equal the verifier-alone ones. Loopback only.
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
from macfleet.bench.sessions import DEFAULT_START_TIMEOUT_S, LocalFleet, _reaped
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen

DEFAULT_SHORT_SESSIONS = 4
DEFAULT_LONG_TOKENS = 16
LONG_AFTER_S = 3.0  # the long prompt arrives once the short sessions decode
SHORT_CAP_TOKENS = 512  # per request; each client asks again until the window closes
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


def run_one(name: str, card, key: bytes, prompt: str, n: int, t0: float,
            until: threading.Event | None = None) -> Timed:
    """One request, streamed; with `until`, reading stops once it is set (the agent finishes
    the session on its own: the protocol has no cancel)."""
    submit = time.perf_counter()
    stamps: list[float] = []
    done = None
    ids: list[int] = []
    for msg in generate_remote(card, key, prompt=prompt, chat=True, max_tokens=n,
                               proposer_spec="ngram", first_token_timeout_s=900.0,
                               silence_s=SILENCE_S):
        if isinstance(msg, GenerateChunk) and msg.token_ids:
            stamps.append(time.perf_counter())
            ids += msg.token_ids
        elif isinstance(msg, GenerateDone):
            done = msg
        if until is not None and until.is_set():
            break
    if done is None and until is None:
        raise RuntimeError(f"{name}: no GenerateDone")
    stamps = stamps or [time.perf_counter()]  # no token before the end (an immediate stop)
    kv = done.stats.fleet.kv if done is not None and done.stats.fleet else None
    return Timed(name, round(submit - t0, 3), round(stamps[0] - submit, 4),
                 tuple(round(b - a, 4) for a, b in zip(stamps, stamps[1:])),
                 len(ids), tuple(done.token_ids if done is not None else ids),
                 asdict(kv) if kv else {})


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


def scenario(card, key: bytes, long_text: str, *, shorts: int, long_tokens: int
             ) -> tuple[list[Timed], tuple[float, float]]:
    """`shorts` sessions start together and decode; once every one of them streams, the long
    prompt arrives. The short sessions are read until the long one's first token (the window:
    its prefill, wherever it runs); returns the runs and the window (s from the round's start)."""
    prompts = list(BENCH_PROMPTS.values())
    out: dict[str, list[Timed] | BaseException] = {}
    first = threading.Event()  # the long prompt's first token: the window ends
    window: list[float] = []
    t0 = time.perf_counter()

    def short(name: str, i: int) -> None:
        """One client: request after request (an answer ends at its EOS) until the window
        closes, so a session is always decoding while the long prompt is prefilled."""
        runs = []
        try:
            while not first.is_set():
                prompt = prompts[(i + len(runs) * shorts) % len(prompts)]
                runs.append(run_one(f"{name}.{len(runs)}", card, key, prompt, SHORT_CAP_TOKENS,
                                    t0, until=first))
            out[name] = runs
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            out[name] = e

    threads = [threading.Thread(target=short, args=(f"short-{i + 1}", i), daemon=True)
               for i in range(shorts)]
    for t in threads:
        t.start()
    time.sleep(LONG_AFTER_S)  # every short session is past its prompt by then
    window.append(time.perf_counter() - t0)
    submit = time.perf_counter()
    stamps: list[float] = []
    done = None
    for msg in generate_remote(card, key, prompt=long_text, chat=True, max_tokens=long_tokens,
                               proposer_spec="ngram", first_token_timeout_s=900.0,
                               silence_s=SILENCE_S):
        if isinstance(msg, GenerateChunk) and msg.token_ids:
            stamps.append(time.perf_counter())
            if not first.is_set():
                window.append(stamps[0] - t0)
                first.set()
        elif isinstance(msg, GenerateDone):
            done = msg
    first.set()
    for t in threads:
        t.join(SILENCE_S)
    if done is None:
        raise RuntimeError("long: no GenerateDone")
    kv = done.stats.fleet.kv if done.stats.fleet else None
    long = Timed("long", round(submit - t0, 3), round(stamps[0] - submit, 4),
                 tuple(round(b - a, 4) for a, b in zip(stamps, stamps[1:])),
                 len(done.token_ids), tuple(done.token_ids), asdict(kv) if kv else {})
    for r in out.values():
        if isinstance(r, BaseException):
            raise r
    return ([long, *(r for i in range(shorts) for r in out[f"short-{i + 1}"])],
            (window[0], window[1]))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def window_gaps(r: Timed, window: tuple[float, float]) -> tuple[list[float], list[float]]:
    """A short session's inter-token gaps that end inside the window, and those before it."""
    t = r.submit_s + r.ttft_s
    inside, before = [], []
    for g in r.gaps_s:
        t += g
        if window[0] <= t <= window[1]:
            inside.append(g)
        elif t < window[0]:
            before.append(g)
    return inside, before


def summarize(runs: list[Timed], window: tuple[float, float]) -> dict:
    shorts = [r for r in runs if r.name.startswith("short")]
    long = next(r for r in runs if r.name == "long")
    inside = [g for r in shorts for g in window_gaps(r, window)[0]]
    before = [g for r in shorts for g in window_gaps(r, window)[1]]
    p50, p99 = pct(inside, 0.5), pct(inside, 0.99)
    return {"window_s": round(window[1] - window[0], 3), "gaps_in_window": len(inside),
            "short_itl_before_s": {"p50": round(pct(before, 0.5), 4)},
            "short_itl_s": {"p50": round(p50, 4), "p99": round(p99, 4),
                            "max": round(max(inside, default=0.0), 4)},
            "p99_over_p50": round(p99 / p50, 2) if p50 else None,
            "long_ttft_s": long.ttft_s, "kv": long.kv,
            "requests": [asdict(r) | {"token_ids": None, "gaps_s": None} for r in runs]}


def bench_disagg(*, model: str = "smollm2", prompt_tokens: tuple[int, ...] = (2000, 8000),
                 shorts: int = DEFAULT_SHORT_SESSIONS, long_tokens: int = DEFAULT_LONG_TOKENS,
                 codecs: tuple[str, ...] = ("auto",),
                 progress: Callable[[str], None] = lambda m: None) -> dict:
    from macfleet.engine.models import load_model

    tok = load_model(model).tokenizer
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    v_cpu, p_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    modes = [("verifier alone", None)] + [(f"prefill agent ({c})", c) for c in codecs]
    sizes = []
    for n in prompt_tokens:
        long_text = long_prompt(tok, n)
        results, ids = [], {}
        for label, codec in modes:
            with tempfile.TemporaryDirectory(prefix="macfleet-disagg-") as tmp:
                key_path = Path(tmp) / "fleet.key"
                key = keygen(key_path)
                agents = [("verifier", v_cpu, ["--no-disagg"] if codec is None else
                           ["--kv-codec", codec])]
                if codec is not None:
                    agents.append(("prefill", p_cpu, []))
                progress(f"{n} tokens, {label}: starting {len(agents)} agent(s) ({model})")
                fleet = start_pinned(agents, model=model, key=key, key_path=key_path,
                                     run_dir=Path(tmp) / "run")
                try:
                    card = fleet.card(fleet.agents[0])
                    run_one("warm-up", card, key, "Hi", 4, time.perf_counter())
                    runs, window = scenario(card, key, long_text, shorts=shorts,
                                            long_tokens=long_tokens)
                finally:
                    fleet.stop()
            ids[label] = next(r.token_ids for r in runs if r.name == "long")
            r = {"mode": label, "codec": codec, **summarize(runs, window)}
            results.append(r)
            progress(f"{n} tokens, {label}: long TTFT {r['long_ttft_s']} s; short ITL in the "
                     f"window p50 {r['short_itl_s']['p50'] * 1e3:.0f} ms, p99 "
                     f"{r['short_itl_s']['p99'] * 1e3:.0f} ms ({r['p99_over_p50']}x), "
                     f"{r['gaps_in_window']} gaps")
        base = ids["verifier alone"]
        for r in results:
            r["long_ids_identical_to_verifier_alone"] = ids[r["mode"]] == base
        sizes.append({"prompt_tokens": n, "modes": results})
    return {"model": model, "short_sessions": shorts, "long_tokens": long_tokens,
            "scenario": f"{shorts} sessions decoding (one continuous batch on the verifier) when "
                        f"the long prompt arrives {LONG_AFTER_S} s later; their inter-token gaps "
                        "in the window from its arrival to its first token",
            "goal": "with a prefill agent, short p99 ITL in the window <= 1.5x its p50",
            "link": "loopback", "cores": {"verifier": v_cpu, "prefill": p_cpu},
            "sizes": sizes}
