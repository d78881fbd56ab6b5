"""A/B across two source trees: issue 49's yardstick is "today's single-session loop", the
pipelined `generate_local` of the tree the issue was measured against (a9cb793), which no longer
exists in this tree (tests/reference_loops.py keeps an unpipelined reference only). One resident
worker process per arm (model loaded once, each from its own tree on PYTHONPATH); the driver asks
them in turn, so only one computes at a time and the arms interleave request by request.

    python results/one-path/ab_trees.py OLD_TREE SPEC[,SPEC] TOKENS REPEATS [--model M] [--core C]
    e.g. git worktree add --detach /tmp/old a9cb793
         python results/one-path/ab_trees.py /tmp/old none,auto 64 4
         python results/one-path/ab_trees.py /tmp/old none,draft:smollm2 64 2 --model wide --core 0

--model wide: the pair issue's verifier (bench/pair_model.py: SmolLM2 with every MLP zero-padded
1536 -> 6144, the same function at ~3x the bytes a token), drafted for by the real SmolLM2
(`draft:smollm2`, the draft model in one process). --core C: every worker pinned to core C
(`taskset`, one BLAS thread: "one Mac = one core"; the workers take turns, so they never share it).

Arms: `loop` (OLD_TREE's generate_local), `old-engine` (OLD_TREE's generate_one, what
`generate --local` ran there), `engine` (this tree's generate_one, what `generate --local` runs).
Per arm: tokens per wall second and CPU ms per token (the worker's process CPU time: every
thread, MLX's stream included), around the generation only; ids compared across arms.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROMPTS = ["Write a Python function that merges two sorted lists into one sorted list.",
           "Explain how a refrigerator keeps food cold.",
           "Describe a busy market on a Saturday morning."]

WORKER = r"""
import json, sys, time
from macfleet.engine.models import load_model
from macfleet.engine.events import Finished
arm = sys.argv[1]
if arm == "loop":
    from macfleet.engine.text import generate_local as run
else:
    from macfleet.serve.one import generate_one as run
lm = load_model(sys.argv[2])
for line in sys.stdin:
    q = json.loads(line)
    t0, c0 = time.perf_counter(), time.process_time()
    ev = list(run(lm, q["prompt"], chat=True, proposer=q["spec"], max_tokens=q["n"]))
    w, c = time.perf_counter() - t0, time.process_time() - c0
    fin = next(e for e in ev if isinstance(e, Finished))
    print(json.dumps({"ids": list(fin.token_ids), "wall": w, "cpu": c}), flush=True)
"""


def worker(tree: str, arm: str, model: str, core: int | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree)
    pin = []
    if core is not None:
        env["OPENBLAS_NUM_THREADS"] = "1"
        pin = ["taskset", "-c", str(core)]
    return subprocess.Popen([*pin, sys.executable, "-c", WORKER, arm, model], cwd=tree, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(p: subprocess.Popen, spec: str, prompt: str, n: int) -> dict:
    p.stdin.write(json.dumps({"spec": spec, "prompt": prompt, "n": n}) + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise RuntimeError("a worker died")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("specs")
    ap.add_argument("tokens", type=int)
    ap.add_argument("repeats", type=int)
    ap.add_argument("--model", default="smollm2", help="smollm2, or wide (the pair's verifier)")
    ap.add_argument("--core", type=int, default=None)
    a = ap.parse_args()
    old, specs, n, reps = a.old, a.specs.split(","), a.tokens, a.repeats
    model = a.model
    if model == "wide":
        from macfleet.bench.pair_model import build_pair_verifier

        model = str(build_pair_verifier(6144))
    print(f"model {model}, core {a.core}", flush=True)
    arms = {name: worker(tree, arm, model, a.core) for name, tree, arm in
            (("loop", old, "loop"), ("old-engine", old, "engine"), ("engine", ROOT, "engine"))}
    try:
        for spec in specs:
            for p in arms.values():
                ask(p, spec, "hi", 8)  # warm
            tot = {a: [0, 0.0, 0.0] for a in arms}
            ids = {a: [] for a in arms}
            order = list(arms)
            for rep in range(reps):
                for prompt in PROMPTS:
                    for a in (order if rep % 2 == 0 else order[::-1]):
                        r = ask(arms[a], spec, prompt, n)
                        tot[a][0] += len(r["ids"])
                        tot[a][1] += r["wall"]
                        tot[a][2] += r["cpu"]
                        ids[a].append(r["ids"])
            base = tot["loop"]
            for a, (k, w, c) in tot.items():
                print(f"{spec} {a:10s} {k / w:5.1f} tok/s wall {1e3 * c / k:6.1f} cpu ms/tok | "
                      f"vs loop: wall {(k / w) / (base[0] / base[1]):.3f}x cpu "
                      f"{(base[2] / base[0]) / (c / k):.3f}x | ids as loop {ids[a] == ids['loop']}",
                      flush=True)
    finally:
        for p in arms.values():
            p.stdin.close()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
