"""`auto`'s chooser replayed on the real answers' text with the AMD EPYC box's costs (issue 44):
text_replay.py (results/drafter-auto-floor-1129) with its day taken from
results/drafter-auto-1130 (that box's fixed drafters' runs, fast-fixed.json, and the verify(L)
shape of its auto traces, fast-repeats.json: steeper than the Xeon's, verify(25) ~2.3 plain
steps against ~1.8). Deterministic, no model, no clock.

  python results/drafter-auto-curse-1130/epyc_replay.py [--ref main] [--tree REF] [--seeds 40]
      [--variant NAME=MODULE_ATTR:VALUE,...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "drafter-auto-1129"))
sys.path.insert(0, str(HERE.parent / "drafter-auto-floor-1129"))
from replay import load_chooser, outcomes, shape  # noqa: E402,F401
from text_replay import day, session  # noqa: E402,F401


DAY = HERE.parent / "drafter-auto-1130"


def report(name: str, res: dict, mods: dict, seeds: int) -> None:
    fx = ("eagle", "eagle2", "retrieval+ngram")
    gfix = {s: math.exp(sum(math.log(r["fixed"][s]) for r in res.values()) / len(res))
            for s in fx}
    best = max(fx, key=gfix.get)
    print(f"## {name}: {len(res)} prompts, {seeds} seeds; speedup over plain (mean, worst "
          f"session); best fixed {best}")
    print(f"{'prompt':16s}" + "".join(f"{s[:10]:>11s}" for s in fx)
          + "".join(f"{m[:15]:>16s}" for m in mods))
    for kind, row in res.items():
        print(f"{kind:16s}" + "".join(f"{row['fixed'][s]:11.3f}" for s in fx)
              + "".join(f"{row[m][0]:>9.3f} ({row[m][1]:.2f})" for m in mods))
    for m in mods:
        g = math.exp(sum(math.log(r[m][0]) for r in res.values()) / len(res))
        below = sum(r[m][0] < 0.97 for r in res.values())
        print(f"  {m:24s} geomean {g:.3f} = {g / gfix[best]:.3f}x best fixed; worst prompt "
              f"{min(r[m][0] for r in res.values()):.3f}, prompts below 0.97x: {below}, "
              f"worst session {min(r[m][1] for r in res.values()):.3f} x plain")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--dir", type=Path, default=DAY, help="the day's folder (drafter-auto-1129: "
                    "the Xeon's fast-prior / slow-prior)")
    ap.add_argument("--runs", default="fast-fixed")
    ap.add_argument("--shape", default="fast-repeats")
    ap.add_argument("--positions", type=Path,
                    default=HERE.parent / "drafter-auto-floor-1129" / "positions.json")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=CONST:VALUE[,CONST:VALUE]: this tree with constants set")
    args = ap.parse_args()
    pos = json.loads(args.positions.read_text())
    mods = {args.ref: load_chooser(args.ref), "tree": load_chooser(args.tree)}
    for v in args.variant:
        name, _, consts = v.partition("=")
        kw = {k: float(x) for k, _, x in (c.partition(":") for c in consts.split(","))}
        mods[name] = load_chooser(args.tree, f"_{len(mods)}", **kw)
    runs_doc = json.loads((args.dir / f"{args.runs}.json").read_text())
    shape_doc = json.loads((args.dir / f"{args.shape}.json").read_text())
    report(f"{args.dir.name}/{args.runs} (shape {args.shape})",
           day(args.runs, pos, mods, args.seeds, runs_doc, shape_doc), mods, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
