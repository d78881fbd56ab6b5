"""`auto` with this tree's chooser and group (engine/chooser.py + engine/choosing.py) against a
git ref's, interleaved in one process on real prompts (issue 44): the same model, drafters and
prior. ab_real.py (results/drafter-auto-floor-1129) swaps the chooser alone; this change also
moves the group (the free candidates draft before the choice), so the ref's arm runs the ref's
ChoosingGroup with the ref's Chooser. Rounds alternate the arms' order, plain decoding in
each; every run's ids must equal plain decoding's.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python \\
      results/drafter-auto-curse-1130/ab_group.py --prompts chat:romeo,code --rounds 3 --ref HEAD
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ref_group(ref: str):
    """The ref's ChoosingGroup class, importing the ref's chooser (both loaded from git)."""
    tmp = Path(tempfile.mkdtemp())
    mods = {}
    for name in ("chooser", "choosing"):
        src = subprocess.run(["git", "-C", str(ROOT), "show",
                              f"{ref}:macfleet/engine/{name}.py"],
                             check=True, capture_output=True, text=True).stdout
        src = src.replace("from macfleet.engine.chooser import", "from ref_chooser import")
        path = tmp / f"ref_{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod

    base = mods["choosing"].ChoosingGroup
    takes_context = "context" in inspect.signature(base.lengths).parameters

    class RefGroup(base):
        def lengths(self, limit, context=None):  # a ref from before the context
            return super().lengths(limit, context) if takes_context else super().lengths(limit)

    return RefGroup


def main() -> int:
    from macfleet.bench.drafter import BENCH_PROMPTS, trace_json
    from macfleet.engine import choosing
    from macfleet.engine.events import Finished
    from macfleet.engine.models import load_model
    from macfleet.serve.one import generate_one

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lm = load_model("smollm2")
    mine, ref = choosing.ChoosingGroup, ref_group(args.ref)
    out: dict = {}

    def run(kind: str, variant: str) -> dict:
        choosing.ChoosingGroup = ref if variant == "ref" else mine
        fin = None
        t0 = time.process_time()
        for ev in generate_one(lm, BENCH_PROMPTS[kind], max_tokens=args.max_tokens,
                               proposer="none" if variant == "none" else "auto"):
            if isinstance(ev, Finished):
                fin = ev
        st = fin.stats
        decode_s = max(st.elapsed_s - st.prefill_ms / 1e3, 1e-9)
        return {"tok_s": st.tokens / decode_s, "cpu_s": time.process_time() - t0,
                "ids": list(fin.token_ids),
                "blocks": Counter(t.drafter for t in st.trace),
                "trace": [trace_json(t) for t in st.trace]}

    for v in ("ref", "tree"):  # a process's first auto run loads the head and the store
        choosing.ChoosingGroup = ref if v == "ref" else mine
        for _ in generate_one(lm, "Hi", proposer="auto", max_tokens=8):
            pass
    for rnd in range(args.rounds):
        order = ("none", "ref", "tree") if rnd % 2 == 0 else ("none", "tree", "ref")
        for kind in args.prompts.split(","):
            for v in order:
                r = run(kind, v)
                rows = out.setdefault(kind, {}).setdefault(v, [])
                rows.append(r)
                base = out[kind]["none"][0]["ids"]
                print(f"round {rnd} {kind:14s} {v:5s} {r['tok_s']:5.2f} tok/s cpu "
                      f"{r['cpu_s']:5.2f} s identical {r['ids'] == base} {dict(r['blocks'])}",
                      flush=True)
    print(f"prompt          {'ref ' + args.ref:>14s}  {'tree':>14s}   (plain's median CPU s "
          "per run over each arm's)")
    for kind, by in out.items():
        plain = statistics.median(r["cpu_s"] for r in by["none"])
        print(f"{kind:14s}  " + "  ".join(
            f"{plain / statistics.median(r['cpu_s'] for r in by[v]):14.3f}"
            for v in ("ref", "tree")))
    if args.out:
        args.out.write_text(json.dumps({k: {v: [{**r, "blocks": dict(r["blocks"])}
                                                  for r in rows] for v, rows in by.items()}
                                         for k, by in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
