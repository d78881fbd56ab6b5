"""`auto` with eagle2's backoff (tree_budget.Backoff) against `auto` without it (its
`should_draft` always True: auto's chooser already decides whether eagle2 drafts), interleaved
in one process on real prompts (issue 44): this tree's chooser in both; ABBA rounds, plain
decoding in each; every run's ids must equal plain decoding's. Columns: plain's median CPU
seconds per run over each variant's.

  python results/drafter-auto-floor-1129/ab_backoff.py --prompts rewrite,chat --rounds 2
      [--out runs.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "drafter-auto-1129"))


def main() -> int:
    from macfleet.engine import tree_budget

    from macfleet.bench.drafter import BENCH_PROMPTS, trace_json
    from macfleet.engine.events import Finished
    from macfleet.engine.models import load_model
    from macfleet.serve.one import generate_one

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ref", default="backoff")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lm = load_model("smollm2")
    keep = tree_budget.Backoff.should_draft
    out: dict = {}

    def run(kind: str, variant: str) -> dict:
        tree_budget.Backoff.should_draft = keep if variant == args.ref else (lambda self: True)
        spec = "none" if variant == "none" else "auto"
        fin = None
        t0 = time.process_time()
        for ev in generate_one(lm, BENCH_PROMPTS[kind], proposer=spec,
                                 max_tokens=args.max_tokens):
            if isinstance(ev, Finished):
                fin = ev
        st = fin.stats
        decode_s = max(st.elapsed_s - st.prefill_ms / 1e3, 1e-9)
        return {"tok_s": st.tokens / decode_s, "cpu_s": time.process_time() - t0,
                "ids": list(fin.token_ids),
                "blocks": Counter(t.drafter for t in st.trace),
                "trace": [trace_json(t) for t in st.trace]}

    # the first auto run of a process loads the head and the answer store: not either's cost
    for _ in generate_one(lm, "Hi", proposer="auto", max_tokens=8):
        pass
    for rnd in range(args.rounds):
        order = ("none", args.ref, "tree") if rnd % 2 == 0 else ("none", "tree", args.ref)
        for kind in args.prompts.split(","):
            for v in order:
                r = run(kind, v)
                rows = out.setdefault(kind, {}).setdefault(v, [])
                rows.append(r)
                base = out[kind]["none"][0]["ids"]
                print(f"round {rnd} {kind:12s} {v:5s} {r['tok_s']:5.2f} tok/s "
                      f"identical {r['ids'] == base} {dict(r['blocks'])}", flush=True)
    print("prompt        " + "  ".join(f"{v:>14s}" for v in (args.ref, "tree"))
          + "   (plain's median CPU s per run over auto's: a shared box's load inflates "
            "wall time more)")
    for kind, by in out.items():
        plain = statistics.median(r["cpu_s"] for r in by["none"])
        print(f"{kind:12s}  " + "  ".join(
            f"{plain / statistics.median(r['cpu_s'] for r in by[v]):14.3f}"
            for v in (args.ref, "tree")))
    if args.out:
        args.out.write_text(json.dumps({k: {v: [{**r, "blocks": dict(r["blocks"])}
                                                  for r in rows] for v, rows in by.items()}
                                         for k, by in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
