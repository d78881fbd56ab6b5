"""`macfleet bench moe`: expert, tensor and pipeline parallelism of the tiny MoE over 2 and 4
shard ranks (real processes, mlx.distributed ring on loopback), measured and predicted.

Per ring size, each mode runs `python -m macfleet.bench.shard_run` (the shard agents' own
ShardGroup): 30 pings (one small all_sum each: the ring's latency as that run sees it), plain
greedy decoding (one token per forward) and speculative decoding with ngram drafts; rank 0
reports wall times and its `ShardStats` (exact collective bytes, ms per forward, router load). Each mode runs
`repeats` times, the modes interleaved (E, T, P, E, T, P, ...) so that a machine whose load
drifts weighs on all of them; the median counts. The planner (topology/moe.py) then predicts
each mode's ms per decode forward from the single-process verify(1) measured here (evaluated),
the part of it that is op dispatch rather than weight reads (verify(1) less the model's bytes at
this machine's matrix-vector read rate: `read_bandwidth_gb_s`; a 2 MB model is nearly all
dispatch, which no mode divides) and the ring's median ping (a hop taken as one of the
all_sum's 2(n-1) ring steps), and the modes are
ranked by that same quantity measured (rank 0's median ms per decode forward; a run's tokens/s
also pays its prefill and start, which the planner does not predict), so the ranking can be
compared side by side. `unpriced_ms_per_forward` is what the planner leaves out (measured
minus predicted: the shard loop's own per-forward work in Python).

Bounded: the ranks load a 2 MB model; a run is a few seconds; every process has a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from macfleet.topology.fleet_spec import GB, Link
from macfleet.topology.inputs import tiny_moe_shape
from macfleet.topology.cost import dispatch_floor_ms
from macfleet.topology.moe import MOE_MODES, RingLatency, bytes_read, choose_moe_mode

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "tiny-moe:1"
DEFAULT_PROMPT = "one two three, one two three, one two three, four five six"
DEFAULT_TOKENS = 16
DEFAULT_REPEATS = 5  # runs per mode, interleaved across modes; the median counts
RUN_TIMEOUT_S = 240.0
LOOPBACK_LINK = Link("rank", "rank", 0.0, 1e6)  # latency comes from the probe; ~1 GB/s bytes


def _ranks(module: str, n: int, tmp: Path, extra: list[str]) -> list[str]:
    """Run n ranks of `python -m module`; their stderr tails (raises on failure). Rank r is
    pinned to core r mod the cores (Linux; as `macfleet up` pins its agents): unpinned, two
    ranks sharing one core for a while made a run's ms per forward 2-4x its median."""
    from agents.daemon import pin_to_cpu
    from agents.shard import free_ports
    from macfleet.bench.shard_run import rank_env, write_hostfile

    hostfile = write_hostfile(str(tmp / "hosts.json"), free_ports(n))
    cores = os.cpu_count() or 1
    procs = [subprocess.Popen([sys.executable, "-m", module, "--hostfile", hostfile,
                               "--rank", str(r), *extra], cwd=ROOT, env=rank_env(str(ROOT)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=partial(pin_to_cpu, r % cores))
             for r in range(n)]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=RUN_TIMEOUT_S)[1][-600:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{module} over {n} ranks failed: {errs}")
    return errs


def single_process(model: str, prompt: list[int], tokens: int, repeats: int = 30) -> dict:
    """Reference ids and the single-process verify(1) / plain decoding rate."""
    import mlx.core as mx

    from macfleet.engine.models import load_model
    from macfleet.engine.verifier import Verifier

    v = Verifier(load_model(model).model)
    v.prefill(prompt[:-1])
    t0 = time.perf_counter()
    last, ids = prompt[-1], []
    for _ in range(tokens):
        last = int(np.argmax(np.array(v.forward([last])[-1])))
        ids.append(last)
    decode_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(v.forward([last]))  # the forward is lazy: time its evaluation too
        times.append((time.perf_counter() - t) * 1e3)
        v.rollback(1)
    return {"ids": ids, "verify1_ms": float(np.median(times)),
            "tokens_per_s": tokens / decode_s}


def read_bandwidth_gb_s(mb: int = 256, repeats: int = 7) -> float:
    """This machine's weight-read rate as a forward sees it: one matrix-vector product over a
    `mb` MB float32 matrix (decode's own kind of op), median of `repeats`."""
    import mlx.core as mx

    n = int((mb * 2**20 / 4) ** 0.5)
    w = mx.random.normal((n, n))
    x = mx.random.normal((1, n))
    mx.eval(w, x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - t)
    return w.nbytes / float(np.median(times)) / 1e9


def _decode_ms(run: dict) -> float:
    """Rank 0's ms per decode forward of one run (its plain decoding less the prefill)."""
    plain, pre = run["plain_shard"], run["prefill_shard"]
    return (plain["forward_ms"] - pre["forward_ms"]) / (plain["forwards"] - pre["forwards"])


def bench_moe(model: str = DEFAULT_MODEL, sizes: tuple[int, ...] = (2, 4),
              tokens: int = DEFAULT_TOKENS, prompt_text: str = DEFAULT_PROMPT,
              repeats: int = DEFAULT_REPEATS,
              progress: Callable[[str], None] = print) -> dict:
    from macfleet.engine.models import load_model

    lm = load_model(model)
    prompt = lm.tokenizer.encode(prompt_text)
    shape = tiny_moe_shape(model)
    ref = single_process(model, prompt, tokens)
    bw = read_bandwidth_gb_s()
    floor = dispatch_floor_ms(ref["verify1_ms"], bytes_read(shape, 1), bw)
    progress(f"single process: verify(1) {ref['verify1_ms']:.2f} ms, "
             f"{ref['tokens_per_s']:.0f} tok/s; weights read at {bw:.1f} GB/s -> "
             f"dispatch floor {floor:.2f} ms of it")
    rows = []
    load_before = os.getloadavg()[0]
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="macfleet-moe-") as d:
            tmp = Path(d)
            runs: dict[str, dict] = {}
            walls: dict[str, list[float]] = {m: [] for m in MOE_MODES}
            decode_ms: dict[str, list[float]] = {m: [] for m in MOE_MODES}
            pings: list[float] = []
            for _ in range(repeats):  # modes interleaved, so the machine's load drifts on all
                for mode in MOE_MODES:
                    out = tmp / f"{mode}.json"
                    _ranks("macfleet.bench.shard_run", n, tmp, [
                        "--mode", mode, "--model", model, "--prompt-ids", json.dumps(prompt),
                        "--max-tokens", str(tokens), "--proposer", "ngram", "--out", str(out),
                        "--deadline", "60"])
                    runs[mode] = json.loads(out.read_text())
                    walls[mode].append(runs[mode]["plain_s"])
                    decode_ms[mode].append(_decode_ms(runs[mode]))
                    pings.append(runs[mode]["ping_ms"])
            for mode, r in runs.items():
                r["plain_s"], r["plain_s_all"] = float(np.median(walls[mode])), walls[mode]
            ping = float(np.median(pings))
            ring = RingLatency(ping, ping / (2 * (n - 1)))
            progress(f"{n} ranks: all_sum {ring.allreduce_ms:.3f} ms (median ping)")
            choice = choose_moe_mode(shape, n, [GB] * n, LOOPBACK_LINK, ref["verify1_ms"],
                                     tokens=1, ring=ring, floor_ms=floor)
            pred = {e.mode: e for e in choice.estimates}
            measured = {m: float(np.median(decode_ms[m])) for m in runs}  # what is predicted
            for mode, r in runs.items():
                plain, spec, pre = r["plain_shard"], r["spec_shard"], r["prefill_shard"]
                decode_fw = plain["forwards"] - pre["forwards"]  # one token each
                e = pred[mode]
                rows.append({
                    "mode": mode, "ranks": n,
                    "ids_match": r["plain_ids"] == ref["ids"] and r["spec_ids"] == ref["ids"],
                    "measured_tokens_per_s": tokens / r["plain_s"],
                    "measured_tokens_per_s_runs": [tokens / s for s in r["plain_s_all"]],
                    "measured_spec_tokens_per_s": tokens / r["spec_s"],
                    "measured_ms_per_decode_forward": float(np.median(decode_ms[mode])),
                    "measured_ms_per_decode_forward_runs": decode_ms[mode],
                    "bytes_per_decode_forward":
                        (plain["collective_bytes"] - pre["collective_bytes"]) / decode_fw,
                    "prefill_bytes": pre["collective_bytes"], "prefill_tokens": pre["tokens"],
                    "control_bytes_per_forward": plain["control_bytes"] / plain["forwards"],
                    "prefill_collective_ms": pre["collective_ms"],
                    "rank_load": plain["rank_load"], "expert_load": plain["expert_load"],
                    "spec_bytes_per_forward": spec["bytes_per_forward"],
                    "predicted_ms_per_forward": e.forward_ms,
                    "unpriced_ms_per_forward":
                        float(np.median(decode_ms[mode])) - e.forward_ms,
                    "predicted_tokens_per_s": 1000.0 / e.forward_ms,
                    "predicted_bytes_per_decode_forward": e.bytes_per_forward,
                    "predicted_mem_per_rank": e.mem_per_rank,
                    "possible": e.possible, "ping_ms": r["ping_ms"]})
                progress(f"  {mode:8s} {tokens / r['plain_s']:7.1f} tok/s measured, "
                         f"{1000 / e.forward_ms:7.1f} predicted, "
                         f"{rows[-1]['bytes_per_decode_forward']:.0f} B/forward, ids match "
                         f"{rows[-1]['ids_match']}")
            m_rank = sorted(measured, key=lambda m: measured[m])
            p_rank = [e.mode for e in choice.estimates]
            rows.append({"ranks": n, "ring_allreduce_ms": ping, "planner_choice": choice.mode,
                         "planner_reason": choice.reason, "predicted_ranking": p_rank,
                         "measured_ranking": m_rank, "ranking_matches": p_rank == m_rank})
    return {"model": model, "tokens": tokens, "prompt_tokens": len(prompt), "repeats": repeats,
            "cpus": os.cpu_count(), "load_average_1m": [load_before, os.getloadavg()[0]],
            "note": "every rank is a process on this one machine, rank r pinned to core r mod "
                    "the cores (Linux): the ranks share its cores with each other past that and "
                    "with whatever else runs (see load_average_1m); the planner prices ranks "
                    "on separate hosts",
            "single_process": {k: v for k, v in ref.items() if k != "ids"},
            "read_bandwidth_gb_s": bw, "dispatch_floor_ms": floor,
            "placement": "expert: rank r holds a contiguous range of every MoE layer's "
                         "experts; attention, embeddings and routers replicated",
            "rows": rows}
