"""`macfleet bench serve`: many streaming clients against a real `macfleet serve` process.

Each configuration is its own server process (one session at a time: `--batch-sessions 1`;
batched without drafts: `--proposer none`; batched with n-gram drafts; batched with token
trees of retrieval + n-gram drafts; batched with the draft head's chains), clients are threads
speaking HTTP + server-sent events like any OpenAI client. Measured per client: time to first
token (TTFT), gaps between streamed chunks (inter-token latency; a chunk can carry several
tokens when drafts are accepted) and completion tokens from the final usage chunk.
Decode stall: 8 decoding streams while a ~2,000-token prompt arrives, chunked prefill on / off.
Every phase is bounded by a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from macfleet.serve.scheduler import DEFAULT_STALL_RATIO

START_TIMEOUT_S = 120.0
CHAT_PROMPTS = (  # open questions: answers longer than max_tokens, so no early EOS skews tok/s
    "Write a short story about a lighthouse keeper.", "Explain how a CPU works.",
    "Give me ten tips for better sleep, with a sentence on each.",
    "Describe the water cycle in detail.",
    "What is the difference between a list and a tuple in Python? Give examples.",
    "Write a long poem about the sea.", "Explain how to bake bread, step by step.",
    "Why is the sky blue? Explain the physics.",
)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 160


@dataclass
class ClientResult:
    ok: bool = False
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    error: str = ""


def start_server(model: str, *extra: str, env: dict | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`serve --local` (env None), or `serve` in front of the fleet that env's MACFLEET_HOME
    holds."""
    where = ["--local"] if env is None else []
    cmd = [sys.executable, "-m", "macfleet", "serve", *where, "--model", model, "--port", "0",
           "--max-sessions-per-client", "64", "--max-prompt-tokens", "4096", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or dict(os.environ))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+/v1)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain
            return proc, m.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"server did not start: {' '.join(cmd)}")


def start_mlx_lm_server(model_dir: str) -> tuple[subprocess.Popen, str]:
    """`mlx_lm.server` on an exported copy of the same weights (its default batching on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", model_dir,
                             "--host", "127.0.0.1", "--port", str(port), "--max-tokens", "512"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("mlx_lm.server did not start")


class FleetServer:
    """A local fleet (`macfleet up`: a verifier and a proposer agent, each pinned to a core)
    in its own MACFLEET_HOME, and `macfleet serve` in front of it."""

    def __init__(self, model: str, batch_sessions: int, proposer: str, *extra: str) -> None:
        self.home = tempfile.mkdtemp(prefix="macfleet-bench-serve-")
        self.env = {**os.environ, "MACFLEET_HOME": self.home}
        r = subprocess.run([sys.executable, "-m", "macfleet", "up", "--model", model, "--agents",
                            "2", "--batch-sessions", str(batch_sessions)], env=self.env,
                           capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"macfleet up failed: {r.stderr[-2000:]}")
        try:
            self.proc, self.url = start_server(model, "--proposer", proposer, *extra,
                                               env=self.env)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        subprocess.run([sys.executable, "-m", "macfleet", "down"], env=self.env,
                       capture_output=True, timeout=60)
        shutil.rmtree(self.home, ignore_errors=True)

    def stop(self) -> None:
        stop_server(self.proc)
        self.down()


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream_one(url: str, body: dict, timeout_s: float, res: ClientResult) -> None:
    """One streaming request; fills res (never raises)."""
    res.t_start = last = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout_s) as c, c.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    res.tokens = ev["usage"]["completion_tokens"]
                ch = ev.get("choices") or [{}]
                text = ch[0].get("text") or (ch[0].get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if res.ttft_s == 0.0:
                        res.ttft_s = now - res.t_start
                    else:
                        res.gaps_s.append(now - last)
                    last = now
        res.ok = res.tokens > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.t_end = time.perf_counter()


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_clients(url: str, n: int, max_tokens: int, timeout_s: float) -> dict:
    results = [ClientResult() for _ in range(n)]
    threads = []
    for i in range(n):
        body = {"messages": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        threads.append(threading.Thread(target=stream_one, daemon=True,
                                        args=(url + "/chat/completions", body, timeout_s,
                                              results[i])))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps_s]
    toks = sum(r.tokens for r in ok)
    return {"clients": n, "ok": len(ok), "failed": n - len(ok), "tokens": toks,
            "wall_s": round(wall, 3), "tokens_per_s": round(toks / wall, 2) if wall else 0.0,
            "ttft_p50_s": round(_pct([r.ttft_s for r in ok], 0.5), 3),
            "ttft_p99_s": round(_pct([r.ttft_s for r in ok], 0.99), 3),
            "itl_p50_s": round(_pct(gaps, 0.5), 4), "itl_p99_s": round(_pct(gaps, 0.99), 4),
            "errors": sorted({r.error for r in results if r.error})}


def client_sweep(url: str, mode: str, clients: list[int], max_tokens: int, deadline: float,
                 progress: Callable[[str], None]) -> list[dict]:
    """One server: a warm-up round of the largest client count (first-call costs are not
    serving: mlx_lm.server's first 16-client round ran at 60% of its later ones), then each
    client count in turn until the deadline."""
    run_clients(url, max(clients, default=1), 4, timeout_s=120)
    rows = []
    for n in clients:
        left = deadline - time.monotonic()
        if left < 10:
            progress(f"{mode}: time limit reached before {n} clients")
            break
        r = run_clients(url, n, max_tokens, timeout_s=left)
        rows.append(r)
        progress(f"{mode:26s} {n:3d} clients: {r['tokens_per_s']:7.2f} tok/s, TTFT p50 "
                 f"{r['ttft_p50_s']:.2f}s, ITL p50/p99 {r['itl_p50_s'] * 1e3:.0f}/"
                 f"{r['itl_p99_s'] * 1e3:.0f} ms, failed {r['failed']}")
    return rows


MODES = {
    "one_at_a_time": ("--batch-sessions", "1", "--proposer", "none"),
    "batched": ("--proposer", "none"),
    "batched_ngram": ("--proposer", "ngram"),
    # token trees in the batch (retrieval + n-gram)
    "batched_trees": ("--proposer", "retrieval+ngram"),
    # the draft head's chains, fed each session's rows of the batched forward (the measured
    # default drafter, `bench drafter`)
    "batched_eagle": ("--proposer", "eagle"),
}
# through a local fleet: the verifier agent's continuous batch (sessions per forward) and the
# proposer the server names (drafted on the proposer agent, per session)
FLEET_MODES = {
    "fleet_one_at_a_time_ngram": (0, "ngram"),
    "fleet_batched_ngram": (16, "ngram"),
    "fleet_batched": (16, "none"),
    # the draft head on the proposer agent, fed each session's rows over F3; the sessions'
    # chains of a round drafted together there
    "fleet_batched_eagle": (16, "eagle"),
}


def bench_fleet_throughput(model: str, clients: list[int], max_tokens: int, deadline: float,
                           progress: Callable[[str], None]) -> dict:
    out: dict[str, list[dict]] = {}
    for mode, (batch, proposer) in FLEET_MODES.items():
        fleet = FleetServer(model, batch, proposer)
        try:
            out[mode] = client_sweep(fleet.url, mode, clients, max_tokens, deadline, progress)
        finally:
            fleet.stop()
    return out


def bench_serve_fleet(model: str, clients: list[int], max_tokens: int, time_limit_s: float,
                      progress: Callable[[str], None]) -> dict:
    """`bench serve --fleet`: the same clients through `macfleet serve` in front of a local
    fleet, its verifier agent batching or not."""
    deadline = time.monotonic() + time_limit_s
    return {"model": model, "max_tokens": max_tokens, "clients": clients,
            "time_limit_s": time_limit_s,
            "fleet": "macfleet up --agents 2 (verifier and proposer agents pinned to one core "
                     "each) + macfleet serve in front",
            "throughput": bench_fleet_throughput(model, clients, max_tokens, deadline,
                                                 progress)}


def bench_throughput(model: str, clients: list[int], max_tokens: int, deadline: float,
                     progress: Callable[[str], None], mlx_lm_dir: str | None = None) -> dict:
    out: dict[str, list[dict]] = {}
    modes = dict(MODES)
    if mlx_lm_dir:
        modes["mlx_lm_server"] = ()
    for mode, extra in modes.items():
        proc, url = (start_mlx_lm_server(mlx_lm_dir) if mode == "mlx_lm_server"
                     else start_server(model, *extra))
        try:
            out[mode] = client_sweep(url, mode, clients, max_tokens, deadline, progress)
        finally:
            stop_server(proc)
    return out


def ratio_summary(pairs: list[tuple[float, float]]) -> dict:
    """Per-round ratios ours/theirs of (ours, theirs) tokens/s (pure): median, min, max and how
    many rounds reach each threshold a goal might name."""
    ratios = sorted(a / b for a, b in pairs if b > 0)
    if not ratios:
        return {"rounds": 0}
    return {"rounds": len(ratios), "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3),
            "rounds_at_least": {f"{t:g}": sum(r >= t for r in ratios) for t in (1.0, 1.5)}}


def head_to_head(model: str, mlx_lm_dir: str, clients: int, max_tokens: int, rounds: int,
                 deadline: float, progress: Callable[[str], None],
                 extra: tuple[str, ...] = MODES["batched"]) -> dict:
    """`macfleet serve --local` (batched) and `mlx_lm.server` both up, the same clients against
    each in alternating short rounds (the order flips every round): this box drifts 10-20%
    between runs, and rounds of the two interleaved drift together, so the ratio of each round
    is the measure, not two runs' totals."""
    ours, ours_url = start_server(model, *extra)
    try:
        theirs, theirs_url = start_mlx_lm_server(mlx_lm_dir)
    except BaseException:
        stop_server(ours)
        raise
    rows: list[dict] = []
    try:
        for url in (ours_url, theirs_url):  # first-call costs are not serving
            run_clients(url, clients, 4, timeout_s=120)
        for i in range(rounds):
            left = deadline - time.monotonic()
            if left < 30:
                progress(f"head to head: time limit reached after {i} rounds")
                break
            order = [("macfleet", ours_url), ("mlx_lm", theirs_url)]
            got = {}
            for name, url in (order if i % 2 == 0 else order[::-1]):
                got[name] = run_clients(url, clients, max_tokens, timeout_s=left / 2)
            rows.append({"round": i, "first": order[0][0] if i % 2 == 0 else order[1][0],
                         **got})
            a, b = got["macfleet"]["tokens_per_s"], got["mlx_lm"]["tokens_per_s"]
            progress(f"round {i}: macfleet {a:.1f} tok/s, mlx_lm.server {b:.1f} tok/s "
                     f"({a / max(b, 1e-9):.2f}x)")
    finally:
        stop_server(ours)
        stop_server(theirs)
    pairs = [(r["macfleet"]["tokens_per_s"], r["mlx_lm"]["tokens_per_s"]) for r in rows
             if not r["macfleet"]["failed"] and not r["mlx_lm"]["failed"]]
    return {"model": model, "clients": clients, "max_tokens": max_tokens,
            "macfleet": "serve --local " + " ".join(extra), "mlx_lm": "mlx_lm.server (its "
            "default batching) on `macfleet export` of the same weights",
            "failed": sum(r[k]["failed"] for r in rows for k in ("macfleet", "mlx_lm")),
            "summary": ratio_summary(pairs), "rounds": rows}


STALL_MODES = {  # the server's default stall ratio, then chunks bounded by the budget alone
    f"chunked, stall ratio {DEFAULT_STALL_RATIO:g}": ("--stall-ratio", f"{DEFAULT_STALL_RATIO:g}"),
    "chunked, token budget only": ("--stall-ratio", "0"),
    "not chunked": ("--no-chunked-prefill",),
}


def bench_stall(model: str, mode: str, deadline: float, decoders: int = 8,
                max_tokens: int = 96) -> dict:
    """ITL of `decoders` streams in the window while a long prompt is prefilled."""
    proc, url = start_server(model, "--proposer", "none", *STALL_MODES[mode])
    try:
        run_clients(url, 1, 4, timeout_s=60)  # warm-up
        left = max(10.0, deadline - time.monotonic())
        res = [ClientResult() for _ in range(decoders)]
        body = {"messages": [{"role": "user", "content": CHAT_PROMPTS[0]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        ts = [threading.Thread(target=stream_one, daemon=True,
                               args=(url + "/chat/completions", body, left, r)) for r in res]
        for t in ts:
            t.start()
        t_wait = time.monotonic() + left
        while time.monotonic() < t_wait and not all(r.ttft_s for r in res):
            time.sleep(0.05)  # every decoder is streaming before the long prompt arrives
        long = ClientResult()
        lbody = {"prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
        stream_one(url + "/completions", lbody, left, long)
        window = (long.t_start, long.t_end)
        for t in ts:
            t.join(max(1.0, deadline - time.monotonic()))
        gaps = []
        for r in res:  # chunk gaps that end inside the prefill window
            t = r.t_start + r.ttft_s
            for g in r.gaps_s:
                t += g
                if window[0] <= t <= window[1] + 1e-3:
                    gaps.append(g)
        all_gaps = [g for r in res for g in r.gaps_s]
        return {"mode": mode, "long_prompt_s": round(long.t_end - long.t_start, 3),
                "long_ok": long.ok, "gaps_in_window": len(gaps),
                "itl_window_p50_s": round(_pct(gaps, 0.5), 4),
                "itl_window_p99_s": round(_pct(gaps, 0.99), 4),
                "itl_max_s": round(max(gaps, default=0.0), 4),
                "itl_overall_p50_s": round(_pct(all_gaps, 0.5), 4)}
    finally:
        stop_server(proc)


def bench_serve(model: str, clients: list[int], max_tokens: int, time_limit_s: float,
                progress: Callable[[str], None], stall: bool = True,
                mlx_lm_dir: str | None = None) -> dict:
    deadline = time.monotonic() + time_limit_s
    res = {"model": model, "max_tokens": max_tokens, "clients": clients,
           "time_limit_s": time_limit_s,
           "throughput": bench_throughput(model, clients, max_tokens,
                                          deadline - (240 if stall else 0), progress,
                                          mlx_lm_dir) if clients else {}}
    if stall:
        res["decode_stall"] = []
        for mode in STALL_MODES:
            r = bench_stall(model, mode, deadline)
            res["decode_stall"].append(r)
            progress(f"stall, {mode}: long prompt {r['long_prompt_s']:.1f}s, ITL in "
                     f"window p50/p99/max {r['itl_window_p50_s'] * 1e3:.0f}/"
                     f"{r['itl_window_p99_s'] * 1e3:.0f}/{r['itl_max_s'] * 1e3:.0f} ms")
    if not mlx_lm_dir:
        res["not_measured"] = "mlx_lm.server (pass --mlx-lm DIR from `macfleet export DIR`)"
    return res


def plot(res: dict, path) -> bool:
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rows in res["throughput"].items():
        xs = [r["clients"] for r in rows]
        ax[0].plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=mode)
        ax[1].plot(xs, [r["itl_p50_s"] * 1e3 for r in rows], marker="o", label=mode)
    ax[0].set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title=res["model"])
    ax[1].set(xlabel="concurrent clients", ylabel="inter-token latency p50 (ms)")
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def summary_rows(res: dict) -> list[str]:
    return [f"{mode}: " + ", ".join(f"{r['clients']}c {r['tokens_per_s']} tok/s" for r in rows)
            for mode, rows in res["throughput"].items()]

