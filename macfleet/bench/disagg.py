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
otherwise).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from bridge.auth import fleet_id
from bridge.discovery import LOOPBACK_ONLY, Browser
from bridge.messages import GenerateChunk, GenerateDone
from macfleet.bench.prompts import BENCH_PROMPTS
from macfleet.bench.sessions import DEFAULT_START_TIMEOUT_S, LocalFleet, _reaped
from macfleet.fleet import local
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


def largest_gaps(runs: list[Timed], window: tuple[float, float], k: int = 10) -> list[dict]:
    """The k longest short-session gaps ending in the window: how long, when (s after the
    long prompt arrived), whose; where the p99 comes from."""
    out = []
    for r in runs:
        if not r.name.startswith("short"):
            continue
        t = r.submit_s + r.ttft_s
        for g in r.gaps_s:
            t += g
            if window[0] <= t <= window[1]:
                out.append({"ms": round(g * 1e3, 1), "at_s": round(t - window[0], 2),
                            "session": r.name})
    return sorted(out, key=lambda x: -x["ms"])[:k]


def summarize(runs: list[Timed], window: tuple[float, float]) -> dict:
    shorts = [r for r in runs if r.name.startswith("short")]
    long = next((r for r in runs if r.name == "long"), None)  # None: the control
    inside = [g for r in shorts for g in window_gaps(r, window)[0]]
    before = [g for r in shorts for g in window_gaps(r, window)[1]]
    p50, p99 = pct(inside, 0.5), pct(inside, 0.99)
    return {"window_s": round(window[1] - window[0], 3), "gaps_in_window": len(inside),
            "short_itl_before_s": {"p50": round(pct(before, 0.5), 4),
                                   "p99": round(pct(before, 0.99), 4), "gaps": len(before)},
            "short_itl_s": {"p50": round(p50, 4), "p99": round(p99, 4),
                            "max": round(max(inside, default=0.0), 4)},
            "p99_over_p50": round(p99 / p50, 2) if p50 else None,
            "long_ttft_s": long.ttft_s if long else None, "kv": long.kv if long else {},
            "largest_gaps": largest_gaps(runs, window),
            "requests": [asdict(r) | {"token_ids": None, "gaps_s": None} for r in runs]}


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


def plot(res: dict, path: Path) -> Path | None:
    """Per prompt size, the short sessions' p50/p99 inter-token gap in the window per mode
    (and the p50 before the long prompt arrived); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = res["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(max(7.5, 5.5 * len(sizes)), 5.0),
                             squeeze=False)
    for ax, size in zip(axes[0], sizes):
        modes = size["modes"]
        x = range(len(modes))
        p50 = [m["short_itl_s"]["p50"] * 1e3 for m in modes]
        p99 = [m["short_itl_s"]["p99"] * 1e3 for m in modes]
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50 in the window", color="tab:blue")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99 in the window", color="tab:orange")
        for i, m in enumerate(modes):
            before = m["short_itl_before_s"]
            ax.plot([i - 0.4, i + 0.4], [before["p50"] * 1e3] * 2, color="black", lw=1.5,
                    label="p50 before it arrived" if i == 0 else None)
            if "p99" in before:
                ax.plot([i - 0.4, i + 0.4], [before["p99"] * 1e3] * 2, color="black", lw=1,
                        ls="--", label="p99 before it arrived" if i == 0 else None)
            ax.text(i, p99[i], f"{m['p99_over_p50']}x\nTTFT {m['long_ttft_s']:.0f} s",
                    ha="center", va="bottom", fontsize=7)
        control = res.get("control")
        if control:
            ax.axhline(control["short_itl_s"]["p99"] * 1e3, color="tab:gray", lw=1, ls=":",
                       label=f"p99 with no long prompt (control, {control['p99_over_p50']}x "
                             "its p50)")
        busy = res.get("busy_control")
        if busy:
            ax.axhline(busy["short_itl_s"]["p99"] * 1e3, color="tab:red", lw=1, ls=":",
                       label=f"p99 with the prefill agent busy for the bench (control, "
                             f"{busy['p99_over_p50']}x its p50)")
        ax.margins(y=0.45)  # room for the labels and the legend above the bars
        ax.set_xticks(list(x))
        ax.set_xticklabels([m["mode"].replace(" (", "\n(") for m in modes], fontsize=7)
        ax.set_ylabel("short sessions' inter-token gap (ms)")
        ax.set_title(f"{size['prompt_tokens']:,}-token prompt arrives")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{res['short_sessions']} decoding sessions while a long prompt is prefilled\n"
                 "(goal: p99 <= 1.5x p50 with a prefill agent)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
