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
(bytes, ms), and whether its greedy ids equal the verifier-alone ones. A control runs the same
short sessions with no long prompt (the prefill agent up and idle): the spread of their gaps
that is the workload's own (speculative blocks, their next prompts' chunks), the yardstick for
what the long prompt adds; a busy control runs them again while the prefill agent computes a
long prompt's KV for the bench itself (`busy_prefill`): its load on this one machine's cores and
memory bus without any KV reaching the verifier, which on two Macs it would not share.

Links: `loopback` (every agent on 127.0.0.1), and `netns-wifi`: the verifier and the prefill
agent each in a network namespace of the test bed (tests/testbed/netns.py: one Linux bridge,
each host's egress a 100 Mbit/s `tbf`, a Wi-Fi-like link), this process on the bridge as the
clients' host; the agents find each other by Zeroconf multicast across the bridge, the KV
crosses the rate-limited link. Needs root and a source checkout (skipped, with the reason,
otherwise). The agents on a link: bench/disagg_agents.py; the reduction and the plot:
bench/disagg_report.py.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

from bridge.messages import GenerateChunk, GenerateDone
from macfleet.bench.disagg_agents import LINKS, agents_up
from macfleet.bench.disagg_report import Timed, plot, summarize  # noqa: F401 (API)
from macfleet.bench.prompts import BENCH_PROMPTS
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen
from macfleet.serve.scheduler import DEFAULT_STALL_RATIO

DEFAULT_SHORT_SESSIONS = 4
DEFAULT_LONG_TOKENS = 16
DEFAULT_CONTROL_S = 60.0  # the control: the same short sessions, no long prompt, this long
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


def long_prompt(tokenizer, n: int) -> str:
    """Text of n tokens (the chat template adds a few)."""
    text = PARAGRAPH
    while len(tokenizer.encode(text)) < n:
        text += PARAGRAPH
    ids = tokenizer.encode(text)[:n]
    return tokenizer.decode(ids)


def busy_prefill(card, key: bytes, model: str, ids: list[int]) -> None:
    """The prefill agent at `card` computes the KV of `ids` for this process, which drops it:
    its load on the machine without the verifier receiving or installing anything (the busy
    control: two agents on one box share its memory bus, two Macs do not)."""
    from agents.remote_prefill import fetch_kv, silence_s
    from macfleet.engine.kvship import model_layout
    from macfleet.engine.models import load_model

    layout = model_layout(load_model(model).model)
    fetch_kv(card.router_endpoint, key, ids=ids, model=model, layout=layout, codec="auto",
             silence=silence_s(512, 0.0), deadline_s=900.0)


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


def scenario(card, key: bytes, long_text: str | None, *, shorts: int, long_tokens: int,
             control_s: float = 0.0, hold: Callable[[], None] | None = None
             ) -> tuple[list[Timed], tuple[float, float]]:
    """`shorts` sessions start together and decode; once every one of them streams, the long
    prompt arrives. The short sessions are read until the long one's first token (the window:
    its prefill, wherever it runs); returns the runs and the window (s from the round's start).
    Without a long prompt (the control), the window is the `control_s` seconds after the
    moment it would have arrived (or as long as `hold()` runs): the same workload's own gaps."""
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
    if long_text is None:
        try:
            hold() if hold is not None else time.sleep(control_s)
        finally:
            window.append(time.perf_counter() - t0)
        first.set()
        for t in threads:
            t.join(SILENCE_S)
        for r in out.values():
            if isinstance(r, BaseException):
                raise r
        return ([r for i in range(shorts) for r in out[f"short-{i + 1}"]],
                (window[0], window[1]))
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


def bench_disagg(*, model: str = "smollm2", prompt_tokens: tuple[int, ...] = (2000, 8000),
                 shorts: int = DEFAULT_SHORT_SESSIONS, long_tokens: int = DEFAULT_LONG_TOKENS,
                 codecs: tuple[str, ...] = ("auto",), links: tuple[str, ...] = LINKS,
                 stall_ratio: float | None = None, control_s: float = DEFAULT_CONTROL_S,
                 busy_tokens: int = 0,
                 progress: Callable[[str], None] = lambda m: None) -> dict:
    from macfleet.bench.f3 import load_testbed
    from macfleet.engine.models import load_model

    tok = load_model(model).tokenizer
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    v_cpu, p_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    skipped = {}
    if "netns-wifi" in links:
        why = load_testbed()[1]
        if why:
            skipped["netns-wifi"] = why
            links = tuple(ln for ln in links if ln != "netns-wifi")
    modes = [("verifier alone", None, "loopback")] + [
        (f"prefill agent ({c})" + ("" if ln == "loopback" else f", {ln}"), c, ln)
        for ln in links for c in codecs]
    stall = [] if stall_ratio is None else ["--stall-ratio", str(stall_ratio)]
    control = busy = None
    if control_s > 0 and any(c is not None for _, c, _ in modes):
        # the goal's yardstick: what the short sessions' gaps spread to on their own (their
        # speculative blocks, their next prompts' chunks), with the prefill agent up and idle
        with tempfile.TemporaryDirectory(prefix="macfleet-disagg-") as tmp:
            key_path = Path(tmp) / "fleet.key"
            key = keygen(key_path)
            progress(f"control: {shorts} sessions, no long prompt, {control_s:.0f} s")
            with agents_up("loopback", [("verifier", v_cpu, stall + ["--kv-codec", "auto"]),
                                        ("prefill", p_cpu, [])],
                           model=model, key=key, key_path=key_path,
                           run_dir=Path(tmp) / "run") as (card, prefill_card):
                run_one("warm-up", card, key, "Hi", 4, time.perf_counter())
                runs, window = scenario(card, key, None, shorts=shorts, long_tokens=0,
                                        control_s=control_s)
                control = {"mode": "no long prompt (control)", "link": "loopback",
                           **summarize(runs, window)}
                progress(f"control: short ITL p50 {control['short_itl_s']['p50'] * 1e3:.0f} "
                         f"ms, p99 {control['short_itl_s']['p99'] * 1e3:.0f} ms "
                         f"({control['p99_over_p50']}x), {control['gaps_in_window']} gaps")
                if busy_tokens > 0:
                    progress(f"busy control: the prefill agent computes a {busy_tokens}-token "
                             "prompt's KV for this bench, not the verifier")
                    hold = partial(busy_prefill, prefill_card, key, model,
                                   tok.encode(long_prompt(tok, busy_tokens)))
                    runs, window = scenario(card, key, None, shorts=shorts, long_tokens=0,
                                            hold=hold)
                    busy = {"mode": "no long prompt, prefill agent busy (control)",
                            "link": "loopback", "busy_tokens": busy_tokens,
                            **summarize(runs, window)}
                    progress(f"busy control: short ITL p50 "
                             f"{busy['short_itl_s']['p50'] * 1e3:.0f} ms, p99 "
                             f"{busy['short_itl_s']['p99'] * 1e3:.0f} ms "
                             f"({busy['p99_over_p50']}x), {busy['gaps_in_window']} gaps")
    sizes = []
    for n in prompt_tokens:
        long_text = long_prompt(tok, n)
        results, ids = [], {}
        for label, codec, link in modes:
            with tempfile.TemporaryDirectory(prefix="macfleet-disagg-") as tmp:
                key_path = Path(tmp) / "fleet.key"
                key = keygen(key_path)
                agents = [("verifier", v_cpu, stall + (["--no-disagg"] if codec is None else
                                                        ["--kv-codec", codec]))]
                if codec is not None:
                    agents.append(("prefill", p_cpu, []))
                progress(f"{n} tokens, {label}: starting {len(agents)} agent(s) ({model}, "
                         f"{link})")
                with agents_up(link, agents, model=model, key=key, key_path=key_path,
                               run_dir=Path(tmp) / "run") as (card, *_):
                    run_one("warm-up", card, key, "Hi", 4, time.perf_counter())
                    runs, window = scenario(card, key, long_text, shorts=shorts,
                                            long_tokens=long_tokens)
            ids[label] = next(r.token_ids for r in runs if r.name == "long")
            r = {"mode": label, "codec": codec, "link": link, **summarize(runs, window)}
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
            "control": control, "busy_control": busy,
            "links": {"loopback": "every agent on 127.0.0.1",
                      "netns-wifi": "verifier and prefill agent in two network namespaces on a "
                                    "Linux bridge, each host's egress a tbf rate 100mbit burst "
                                    "32kbit latency 50ms (tests/testbed/netns.py WIFI_*); the "
                                    "clients on the bridge"},
            "stall_ratio": stall_ratio if stall_ratio is not None else DEFAULT_STALL_RATIO,
            "skipped": skipped, "cores": {"verifier": v_cpu, "prefill": p_cpu},
            "sizes": sizes}
