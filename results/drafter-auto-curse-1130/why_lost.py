"""Where a replayed `auto` session loses against plain decoding (epyc_replay.py's day): each
block's cost less plain steps for its tokens, summed by why it was drafted and by drafter,
mean over seeds. python results/drafter-auto-curse-1130/why_lost.py [--tree REF] PROMPT..."""
import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from epyc_replay import DAY, load_chooser, outcomes, session, shape  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--const", default="")
    args = ap.parse_args()
    kw = {k: float(x) for k, _, x in (c.partition(":") for c in args.const.split(",") if c)}
    mod = load_chooser(args.tree, "_w", **kw)
    made = []
    orig = mod.Chooser.__post_init__
    def hook(self):
        orig(self)
        made.append(self)
    mod.Chooser.__post_init__ = hook
    pos = json.loads((HERE.parent / "drafter-auto-floor-1129/positions.json").read_text())
    runs = json.loads((DAY / "fast-fixed.json").read_text())["in_process"]["runs"]
    sh = shape(json.loads((DAY / "fast-repeats.json").read_text()))
    for kind in args.prompts:
        r = runs[kind]
        v1 = r["none"]["verify_ms"] / r["none"]["blocks"]
        table = {L: s * v1 for L, s in sh.items()}
        dists = {s: outcomes(r[s]) for s in ("eagle", "eagle2")}
        why, who, ratio = defaultdict(float), defaultdict(float), 0.0
        for seed in range(args.seeds):
            made.clear()
            ratio += v1 / session(mod, pos[kind], dists, table, seed) / args.seeds
            for b in made[-1].trace:
                lost = b.draft_ms + b.verify_ms - (1 + b.accepted) * v1
                why[b.why] += lost / args.seeds
                who[f"{b.drafter}/{b.why}"] += lost / args.seeds
        print(f"{kind}: {ratio:.3f}x plain (step {v1:.0f} ms); lost ms by why: "
              + ", ".join(f"{k} {v:+.0f}" for k, v in sorted(why.items())))
        print("   by drafter/why: " + ", ".join(
            f"{k} {v:+.0f}" for k, v in sorted(who.items(), key=lambda kv: -abs(kv[1]))[:10]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
