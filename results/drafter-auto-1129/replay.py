"""A fixed-clock replay of `auto`'s chooser on the recorded runs (issue 44): no model, no clock.

Per prompt, each fixed drafter's recorded run (fast.json / slow.json: blocks, drafted, its
accepted-per-block histogram, draft ms per block) is a distribution of block outcomes; plain
decoding's run gives the prompt's verify(1), and auto's traces the shape of verify(L) (median
verify(L) / verify(1) over every traced block of the day). A session draws each block's
outcome from its candidate's distribution (seeded: deterministic), the chosen block costs its
draft ms plus verify(L), and the answer ends at 96 tokens. The free candidate
(retrieval+ngram) is scored every block from the same draw it would have drafted. Each fixed
drafter is replayed the same way, so a ratio compares decisions, not machines.

Candidates: plain, eagle, eagle2, retrieval+ngram (free): the ones the recorded runs measured
alone (auto's ngram, retrieval and eagle2+retrieval+ngram are left out). `--unlucky N`: the
first N blocks eagle2 drafts accept nothing (what explain's text does to it at blocks 1 and 3,
on both days, in every run).

  python results/drafter-auto-1129/replay.py [--ref main] [--seeds 40] [--unlucky 2]

compares this tree's chooser with the one at git ref `--ref`, and a prior per candidate
(pooled acceptance of the day's run) with the winner's speedup alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FIXED = ("none", "eagle", "eagle2", "retrieval+ngram")
TOKENS = 96


def load_chooser(ref: str | None, tag: str = "", **consts):
    """engine/chooser.py of this tree (None) or of a git ref, as a module of its own (its
    constants set from `consts`: variants side by side)."""
    src = ((ROOT / "macfleet/engine/chooser.py").read_text() if ref is None else subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:macfleet/engine/chooser.py"],
        check=True, capture_output=True, text=True).stdout)
    path = Path(tempfile.mkdtemp()) / f"chooser_{(ref or 'tree').replace('/', '_')}{tag}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    for k, v in consts.items():
        setattr(mod, k, v)
    return mod


def shape(doc: dict) -> dict[int, float]:
    """Median verify(L) / verify(1) by L over the day's traced blocks."""
    by: dict[int, list[float]] = {}
    for r in doc["in_process"]["runs"].values():
        tr = r["auto"]["trace"]
        v1 = sorted(t["verify_ms"] for t in tr if t["length"] == 1)
        for t in tr:
            by.setdefault(t["length"], []).append(t["verify_ms"] / v1[len(v1) // 2])
    return {L: sorted(v)[len(v) // 2] for L, v in sorted(by.items()) if len(v) >= 5}


def outcomes(run: dict) -> tuple[list[int], float, float]:
    """(accepted per block, every block of the run, empty ones as 0), mean tokens verified
    per block, draft ms per block."""
    hist = run["accepted_hist"]
    acc = [i for i, c in enumerate(hist) for _ in range(c)]
    acc += [0] * (run["blocks"] - len(acc))
    return acc, 1 + run["drafted"] / run["blocks"], run["draft_ms"] / run["blocks"]


def session(mod, dists, table, v1, seed, prior, unlucky, fixed=None):
    """ms to commit TOKENS tokens: auto (fixed None) or one fixed drafter."""
    rng = random.Random(seed)
    table_ms = {L: s * v1 for L, s in table.items()}
    cands = [mod.Candidate("none"), mod.Candidate("retrieval+ngram", (0,), free=True),
             mod.Candidate("eagle", (1,)), mod.Candidate("eagle2", (2,))]
    curve = mod.VerifyCurve()
    curve.seed(table_ms)
    machine = mod.VerifyCurve()
    machine.seed(table_ms)
    c = mod.Chooser(cands, curve=curve, prior=prior)
    e2_blocks = 0
    ms, tokens = 0.0, 0
    while tokens < TOKENS:
        draws = {}
        for name, (acc, L, dms) in dists.items():
            a = rng.choice(acc)
            draws[name] = (a, round(L) if a + 1 <= round(L) else a + 1, dms)
        name = fixed or c.choose().drafter
        if name == "eagle2":
            if e2_blocks < unlucky:
                draws["eagle2"] = (0,) + draws["eagle2"][1:]
            e2_blocks += 1
        a, L, dms = (0, 1, 0.0) if name == "none" else draws[name]
        vms = machine.cost(L)
        if fixed is None:
            c.observe(name, a, L, dms, vms)
            if name != "retrieval+ngram":
                c.shadow("retrieval+ngram", *draws["retrieval+ngram"])
        ms += dms + vms
        tokens += 1 + a
    return ms / tokens  # ms per token


def day(path: Path, mods: dict, seeds: int, unlucky: int) -> dict:
    doc = json.loads(path.read_text())
    table = shape(doc)
    runs = doc["in_process"]["runs"]
    # the per-candidate prior: the day's pooled acceptance per block and tokens verified
    pooled = {}
    for s in FIXED[1:]:
        blocks = sum(r[s]["blocks"] for r in runs.values())
        pooled[s] = (sum(r[s]["accepted"] for r in runs.values()) / blocks,
                     1 + sum(r[s]["drafted"] for r in runs.values()) / blocks)
    out = {}
    for kind, r in runs.items():
        v1 = r["none"]["verify_ms"] / r["none"]["blocks"]
        dists = {s: outcomes(r[s]) for s in FIXED[1:]}
        fixed = {s: sum(session(mods["new"], dists, table, v1, seed, {}, 0, fixed=s)
                        for seed in range(seeds)) / seeds for s in FIXED}
        row = {"fixed": {s: fixed["none"] / v for s, v in fixed.items()}}
        for label, (mod, prior) in mods["policies"].items():
            p = prior(pooled) if callable(prior) else prior
            per = [fixed["none"] / session(mod, dists, table, v1, seed, p, unlucky)
                   for seed in range(seeds)]
            row[label] = (sum(per) / seeds, min(per))
        out[kind] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--unlucky", type=int, default=0)
    ap.add_argument("--days", default="fast,slow")
    ap.add_argument("--tries", type=int, nargs="*", default=[],
                    help="also this tree with PRIOR_TRIES set to each")
    args = ap.parse_args()
    old, new = load_chooser(args.ref), load_chooser(None)
    winner = {"eagle": 1.153}  # the shipped record's
    def per_candidate(mod):
        return lambda pooled: {**{s: mod.Prior(accepted=a, verified=L)
                                  for s, (a, L) in pooled.items()},
                               "eagle": mod.Prior(1.153, *pooled["eagle"])}

    # a ref from before the per-candidate prior takes the winner's speedup alone
    policies = {f"{args.ref}": (old, per_candidate(old) if hasattr(old, "Prior") else winner)}
    if hasattr(new, "Prior"):
        policies["new, per-candidate prior"] = (new, per_candidate(new))
        for tries in args.tries:
            m = load_chooser(None, f"_t{tries}", PRIOR_TRIES=tries)
            policies[f"new, PRIOR_TRIES={tries}"] = (m, per_candidate(m))
    mods = {"new": new, "policies": policies}
    for d in args.days.split(","):
        res = day(HERE / f"{d}.json", mods, args.seeds, args.unlucky)
        print(f"## {d} day, {args.seeds} seeds, eagle2's first {args.unlucky} blocks unlucky")
        print(f"{'prompt':16s}" + "".join(f"{s:>10s}" for s in FIXED[1:])
              + "".join(f"  {p[:24]:>24s}" for p in policies))
        gm = {p: [] for p in policies}
        worst = {p: 9.0 for p in policies}
        # the best fixed drafter of the run (geomean over prompts), as the bench reads it
        bestf = max(FIXED[1:], key=lambda s: sum(math.log(r["fixed"][s]) for r in res.values()))
        print(f"best fixed: {bestf}")
        for kind, row in res.items():
            best = row["fixed"][bestf]
            line = f"{kind:16s}" + "".join(f"{row['fixed'][s]:10.2f}" for s in FIXED[1:])
            for p in policies:
                mean, lo = row[p]
                gm[p].append(mean / best)
                worst[p] = min(worst[p], lo)
                line += f"  {mean:8.2f} ({mean / best:.2f}, lo {lo:.2f})"
            print(line)
        for p in policies:
            g = math.exp(sum(map(math.log, gm[p])) / len(gm[p]))
            print(f"  {p:28s} vs best fixed geomean {g:.3f}, worst prompt mean "
                  f"{min(gm[p]):.3f}; worst session vs plain {worst[p]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
