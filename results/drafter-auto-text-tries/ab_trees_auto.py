"""`auto` of this tree against `auto` of another tree (issue 44), and both against plain
decoding, interleaved on real prompts. The two trees differ in engine/chooser.py and
engine/choosing.py (the group that drafts a try read off the text), so one chooser cannot be
swapped into the other's module (drafter-auto-floor-1129/ab_real.py): one resident worker
process per arm instead (model loaded once, each from its own tree on PYTHONPATH); the driver
asks them in turn, so only one computes at a time.

    git worktree add --detach /tmp/old44 main
    python results/drafter-auto-text-tries/ab_trees_auto.py /tmp/old44 \
        --prompts chat:romeo,chat:sky,chat:heating,paragraph,code --rounds 3 --out runs.json

Arms: `plain` (this tree, `--proposer none`), `old` (OLD_TREE's `auto`), `new` (this tree's
`auto`); in each round plain first, then old/new in alternating order. Per run: decode tokens
per second (as `bench drafter`: the tokens over the generation's time less its prefill), the
worker's CPU seconds, ids against plain's, and the chooser's trace. Summary per prompt: the
median over rounds of auto / plain for both arms, by decode tok/s and by CPU s.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "results", "one-path"))
from ab_trees import ask  # noqa: E402  (one request to a resident worker, one answer)

WORKER = r"""
import json, sys, time
from dataclasses import asdict
from macfleet.bench.drafter import BENCH_PROMPTS
from macfleet.engine.events import Finished
from macfleet.engine.models import load_model
from macfleet.serve.one import generate_one
lm = load_model("smollm2")
for line in sys.stdin:
    q = json.loads(line)
    c0 = time.process_time()
    fin = None
    for ev in generate_one(lm, BENCH_PROMPTS[q["prompt"]], proposer=q["spec"],
                           max_tokens=q["n"]):
        if isinstance(ev, Finished):
            fin = ev
    st = fin.stats
    decode_s = max(st.elapsed_s - st.prefill_ms / 1e3, 1e-9)
    print(json.dumps({"ids": list(fin.token_ids), "tok_s": st.tokens / decode_s,
                      "cpu_s": time.process_time() - c0,
                      "trace": [asdict(t) for t in st.trace]}), flush=True)
"""


def worker(tree: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree)
    return subprocess.Popen([sys.executable, "-c", WORKER], cwd=tree, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def summary(runs: dict) -> list[str]:
    lines = [f"{'prompt':<16}{'old tok/s':>11}{'new tok/s':>11}{'old cpu':>9}{'new cpu':>9}"
             "   (median over rounds of auto / plain)"]
    for kind, rounds in runs.items():
        r = {arm: [x[arm] for x in rounds] for arm in ("plain", "old", "new")}
        tok = {a: statistics.median(x["tok_s"] / p["tok_s"] for x, p in zip(r[a], r["plain"]))
               for a in ("old", "new")}
        cpu = {a: statistics.median(p["cpu_s"] / x["cpu_s"] for x, p in zip(r[a], r["plain"]))
               for a in ("old", "new")}
        lines.append(f"{kind:<16}{tok['old']:>11.3f}{tok['new']:>11.3f}{cpu['old']:>9.3f}"
                     f"{cpu['new']:>9.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    arms = {"plain": worker(ROOT), "old": worker(args.old), "new": worker(ROOT)}
    runs: dict = {k: [] for k in args.prompts.split(",")}
    try:
        for a in arms.values():  # a warm-up each (first-use costs out of every arm's runs)
            ask(a, "auto", "chat", 8)
        for rnd in range(args.rounds):
            for kind in runs:
                order = ["plain", "old", "new"] if rnd % 2 == 0 else ["plain", "new", "old"]
                got = {}
                for arm in order:
                    got[arm] = ask(arms[arm], "none" if arm == "plain" else "auto", kind,
                                   args.max_tokens)
                    same = got[arm]["ids"] == got["plain"]["ids"]
                    tries = Counter(t["text_try"] for t in got[arm]["trace"]
                                    if t.get("text_try"))
                    why = Counter(t["why"] for t in got[arm]["trace"])
                    print(f"round {rnd} {kind:<14}{arm:<6}{got[arm]['tok_s']:6.2f} tok/s "
                          f"cpu {got[arm]['cpu_s']:6.2f} s identical {same} {dict(why)} "
                          f"text tries {dict(tries)}", flush=True)
                    if not same:
                        raise SystemExit(f"{arm} on {kind}: ids differ from plain decoding")
                runs[kind].append(got)
    finally:
        for a in arms.values():
            a.stdin.close()
            a.wait(timeout=60)
    print("\n".join(summary(runs)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "runs": runs}, f)


if __name__ == "__main__":
    main()
