"""A/B: one request through the single-session loop (generate_local, now the tests' reference:
tests/reference_loops.py) vs the serving engine (BatchEngine, one request, stepped on this
thread). CPU s per token, interleaved. Run from the repository root.
AB_SYNC=1: a third arm, the engine without its step ahead (BatchEngine(step_ahead=False)).
AB_DRY=1: also count, per arm, the dispatches (mx.async_eval) that found MLX's CPU stream thread
asleep, i.e. run dry waiting for the host (Linux /proc; a figure a shared box moves little)."""
import os, sys, threading, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import mlx.core as mx
from reference_loops import generate_local
from macfleet.engine.models import load_model
from macfleet.engine.text import encode_prompt
from macfleet.engine.events import Finished
from macfleet.engine.sampling import GREEDY
from macfleet.serve.engine import BatchEngine, EngineRequest

lm = load_model(sys.argv[4] if len(sys.argv) > 4 else "smollm2")
prompts = ["Write a Python function that merges two sorted lists into one sorted list.",
           "Explain how a refrigerator keeps food cold.",
           "Describe a busy market on a Saturday morning."]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 96
specs = sys.argv[1].split(",")

def loop(spec, p):
    t0, c0 = time.perf_counter(), time.process_time()
    ev = list(generate_local(lm, p, chat=True, proposer=spec, max_tokens=N))
    fin = next(e for e in ev if isinstance(e, Finished))
    return list(fin.token_ids), time.perf_counter() - t0, time.process_time() - c0

engines = {}
def eng(spec, p, ahead=True):
    if (spec, ahead) not in engines:
        engines[spec, ahead] = BatchEngine(lm, proposer=spec, max_active=1, step_ahead=ahead)
    e = engines[spec, ahead]
    ids = encode_prompt(lm.tokenizer, p, True)
    out = []
    t0, c0 = time.perf_counter(), time.process_time()
    e.submit(EngineRequest(tuple(ids), GREEDY, N, eos_ids=frozenset(lm.eos_ids)), out.append)
    e.run_until_idle()
    fin = next(x for x in out if isinstance(x, Finished))
    return list(fin.token_ids), time.perf_counter() - t0, time.process_time() - c0

def sync(spec, p):
    return eng(spec, p, ahead=False)

arms = [("loop", loop), ("eng", eng)] + ([("sync", sync)] if os.environ.get("AB_SYNC") else [])
dry, arm_now = {}, [None]
if os.environ.get("AB_DRY"):
    main_tid = threading.get_native_id()
    def _cpu(t):
        with open(f"/proc/self/task/{t}/schedstat") as f:
            return int(f.read().split()[0])
    loop(specs[0], "hi")  # MLX's stream thread: the busiest one besides this
    stream = max((int(t) for t in os.listdir("/proc/self/task") if int(t) != main_tid), key=_cpu)
    _async_eval = mx.async_eval
    def _counted(*a, **k):
        if arm_now[0]:
            with open(f"/proc/self/task/{stream}/stat") as f:
                asleep = f.read().rsplit(")", 1)[1].split()[0] == "S"
            n = dry.setdefault(arm_now[0], [0, 0]); n[0] += 1; n[1] += asleep
        return _async_eval(*a, **k)
    mx.async_eval = _counted
for spec in specs:
    for _, f in arms:
        f(spec, "hi")  # warm
    tot = {name: [0, 0, 0] for name, _ in arms}
    for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
        for p in prompts:
            for name, f in arms if rep % 2 == 0 else arms[::-1]:
                arm_now[0] = name
                ids, w, c = f(spec, p)
                arm_now[0] = None
                tot[name][0] += len(ids); tot[name][1] += w; tot[name][2] += c
                tot.setdefault(name + "_ids", []).append(ids)
    same = tot["loop_ids"] == tot["eng_ids"]
    l, e = tot["loop"], tot["eng"]
    print(f"{spec}: loop {l[0]/l[1]:.1f} tok/s wall, {1e3*l[2]/l[0]:.1f} cpu ms/tok | engine {e[0]/e[1]:.1f} tok/s wall, {1e3*e[2]/e[0]:.1f} cpu ms/tok | engine/loop cpu {l[2]/l[0]/(e[2]/e[0]):.3f}x wall {(e[0]/e[1])/(l[0]/l[1]):.3f}x | identical {same}", flush=True)
    if "sync" in tot:
        y = tot["sync"]
        print(f"{spec}: engine without step ahead {y[0]/y[1]:.1f} tok/s wall, {1e3*y[2]/y[0]:.1f} cpu ms/tok | /loop cpu {l[2]/l[0]/(y[2]/y[0]):.3f}x wall {(y[0]/y[1])/(l[0]/l[1]):.3f}x | identical {tot['sync_ids'] == tot['loop_ids']}", flush=True)
    if dry:
        print(f"{spec}: dispatches that found the stream asleep: " + ", ".join(
            f"{name} {a}/{n} ({100 * a / n:.0f}%)" for name, (n, a) in dry.items()), flush=True)
        dry.clear()
