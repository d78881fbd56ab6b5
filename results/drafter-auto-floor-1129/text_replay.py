"""`auto`'s chooser replayed on the real answers' text (issue 44): no model, no clock.

replay.py (results/drafter-auto-1129) draws every drafter's blocks independently from its
run's histogram; the free drafters (n-gram lookup, the answer store) are not independent from
block to block (a copy runs on for many blocks, then stops), and the chooser reads them on
every block from the text. Here their outcome at every answer position is the real one
(positions.py: what a greedy verifier accepts of their draft there), so a session meets the
free drafters' real runs and gaps; EAGLE's chains and trees (they need the model) are drawn
as replay.py does, from the day's recorded runs of the prompt. A session's costs: each block's
drafting, and verify(L) = the day's traced shape times the prompt's plain step.

Candidates: auto's (engine/choosing.py auto_candidates: plain, ngram, retrieval,
retrieval+ngram free; eagle, eagle2, eagle2+retrieval+ngram); prior: the shipped record's
figures. A chosen free n-gram drafts free_chain_k's lengths (4, 8, 16); the fixed
`retrieval+ngram` is replayed the same way (the chooser always choosing it).

  python results/drafter-auto-floor-1129/text_replay.py [--ref main] [--tree d32dee1]
      [--seeds 40] [--ablate] [--without CANDIDATE[,CANDIDATE] ...]

--ablate: the tree (d32dee1) without each of its two changes; --without: the tree without
those candidates.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "drafter-auto-1129"))
from replay import ROOT, load_chooser, outcomes, shape  # noqa: E402

RUNS = HERE.parent / "drafter-auto-1129"
FREE_MS = 0.5  # a free drafter's draft (traced: 0.2-1 ms)


def free_k(k: int, drafted: int, accepted: int) -> int:
    return min(2 * k, 16) if drafted >= k > 0 and accepted >= drafted else 4


def shipped_prior(mod) -> dict:
    p = json.loads((ROOT / "macfleet/engine/proposers/weights/smollm2-eagle.eval.json")
                   .read_text())["bench"]
    out = {n: mod.Prior(accepted=f["accepted"], verified=f["verified"])
           for n, f in p["drafters"].items()}
    out[p["best"]] = mod.Prior(p["speedup"], out[p["best"]].accepted, out[p["best"]].verified)
    return out


def session(mod, pos, dists, table_ms, seed, fixed=None, trace=None):
    """ms per token over the answer: auto (fixed None) or one fixed candidate."""
    rng = random.Random(seed)
    cands = [mod.Candidate("none"), mod.Candidate("ngram", (0,), free=True),
             mod.Candidate("retrieval", (1,), free=True),
             mod.Candidate("retrieval+ngram", (1, 0), free=True),
             mod.Candidate("eagle", (3,)), mod.Candidate("eagle2", (2,)),
             mod.Candidate("eagle2+retrieval+ngram", (2, 1, 0))]
    cands = [c for c in cands if c.name not in getattr(mod, "WITHOUT", ())]
    curve = mod.VerifyCurve()
    curve.seed(table_ms)
    machine = mod.VerifyCurve()
    machine.seed(table_ms)
    c = mod.Chooser(cands, curve=curve, prior=shipped_prior(mod))
    takes_sizes = "sizes" in inspect.signature(c.choose).parameters
    depth_ok = "depth" in inspect.signature(c.shadow).parameters
    n = len(pos["ngram4"])
    at, ms, k = 0, 0.0, 4
    while at < n:
        draw = {}
        for s in ("eagle", "eagle2"):
            acc, L, dms = dists[s]
            a = rng.choice(acc)
            draw[s] = (a, max(round(L), a + 1), dms)
        ng4, ngk = pos["ngram4"][at], pos[f"ngram{k}"][at]
        ret = pos["retrieval"][at]
        free = {"ngram": (ngk[0], 1 + ngk[1], FREE_MS, ngk[1]),
                "retrieval": (ret[0], 1 + ret[1], FREE_MS, ret[2]),
                "retrieval+ngram": (max(ret[0], ngk[0]), 1 + ret[1] + ngk[1], FREE_MS,
                                    max(ret[2], ngk[1]))}
        shadows = {"ngram": (ng4[0], 1 + ng4[1], FREE_MS, ng4[1]),
                   "retrieval": free["retrieval"],
                   "retrieval+ngram": (max(ret[0], ng4[0]), 1 + ret[1] + ng4[1], FREE_MS,
                                       max(ret[2], ng4[1]))}
        # a chooser that prices free candidates at their block now (drafter-auto-curse-1130)
        now = {"ngram": 1 + ngk[1], "retrieval": 1 + ret[1],
               "retrieval+ngram": min(25, 1 + ret[1] + ngk[1])}
        name = fixed or (c.choose(sizes=now) if takes_sizes else c.choose()).drafter
        if name == "none":
            a, L, dms = 0, 1, 0.0
        elif name in free:
            a, L, dms = free[name][:3]
            if name != "retrieval":  # the chosen n-gram's next length (choosing.py)
                k = free_k(k, ngk[1], ngk[0])
        elif name == "eagle2+retrieval+ngram":
            e = draw["eagle2"]
            a, L, dms = max(e[0], ret[0], ng4[0]), min(25, e[1] + ret[1] + ng4[1]), e[2]
        else:
            a, L, dms = draw[name]
        a = min(a, n - at - 1)
        vms = machine.cost(L)
        if fixed is None:
            c.observe(name, a, L, dms, vms)
            for s, sh in shadows.items():
                if s != name and s not in getattr(mod, "WITHOUT", ()):
                    c.shadow(s, *sh[:3], **({"depth": sh[3]} if depth_ok else {}))
        if trace is not None:
            trace.append((at, name, a, L))
        ms += dms + vms
        at += 1 + a
    return ms / n


def day(name: str, pos: dict, mods: dict, seeds: int, doc: dict | None = None,
        shape_doc: dict | None = None) -> dict:
    """The day's runs (RUNS/name.json, or `doc`) replayed; verify(L)'s shape from the same
    file's auto traces (or `shape_doc`'s: drafter-auto-curse-1130/epyc_replay.py)."""
    doc = doc or json.loads((RUNS / f"{name}.json").read_text())
    sh = shape(shape_doc or doc)
    out = {}
    for kind, r in doc["in_process"]["runs"].items():
        if kind not in pos:
            continue
        v1 = r["none"]["verify_ms"] / r["none"]["blocks"]
        table_ms = {L: s * v1 for L, s in sh.items()}
        dists = {s: outcomes(r[s]) for s in ("eagle", "eagle2")}
        any_mod = next(iter(mods.values()))
        row = {"fixed": {s: v1 / (sum(session(any_mod, pos[kind], dists, table_ms, seed, s)
                                       for seed in range(seeds)) / seeds)
                         for s in ("eagle", "eagle2", "retrieval+ngram")}}
        for label, mod in mods.items():
            per = [v1 / session(mod, pos[kind], dists, table_ms, seed)
                   for seed in range(seeds)]
            row[label] = (sum(per) / seeds, min(per))
        out[kind] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--days", default="fast-prior,slow-prior")
    ap.add_argument("--positions", type=Path, default=HERE / "positions.json")
    ap.add_argument("--tree", default=None,
                    help="git ref of the chooser in the 'tree' column (default: this tree; "
                         "d32dee1: the composed prior and the held-back first try)")
    ap.add_argument("--without", nargs="*", default=[],
                    help="also this tree without these candidates (comma-separated), each")
    ap.add_argument("--ablate", action="store_true",
                    help="also this tree without each of its changes on main (issue 44 floor)")
    args = ap.parse_args()
    pos = json.loads(args.positions.read_text())
    mods = {args.ref: load_chooser(args.ref), "tree": load_chooser(args.tree)}
    for name in args.without:
        mods[f"-{name}"] = load_chooser(args.tree, f"_w{len(mods)}", WITHOUT=name.split(","))
    if args.ablate:
        mods["-composed"] = load_chooser(args.tree, "_b")
        mods["-composed"].composed_prior = lambda *a: None
        mods["-first"] = m = load_chooser(args.tree, "_c")
        m.Chooser._first_try = lambda self, c, best: (self._est[c.name].n == 0
                                                       or self._est[c.name].tries == 0)
    for d in args.days.split(","):
        res = day(d, pos, mods, args.seeds)
        fx = ("eagle", "eagle2", "retrieval+ngram")
        gfix = {s: math.exp(sum(math.log(r["fixed"][s]) for r in res.values()) / len(res))
                for s in fx}
        best = max(fx, key=gfix.get)
        # the bench's own rule (bench/drafter.py best_spec): the best geomean among drafters
        # whose slowest prompt stays >= 0.97x plain
        safe = [s for s in fx if min(r["fixed"][s] for r in res.values()) >= 0.97]
        rule = max(safe, key=gfix.get) if safe else best
        print(f"## {d}: {len(res)} prompts, {args.seeds} seeds; speedup over plain (mean, "
              f"worst session); best fixed {best}")
        print(f"{'prompt':16s}" + "".join(f"{s[:10]:>11s}" for s in fx)
              + "".join(f"{m:>16s}" for m in mods))
        for kind, row in res.items():
            print(f"{kind:16s}" + "".join(f"{row['fixed'][s]:11.3f}" for s in fx)
                  + "".join(f"{row[m][0]:>9.3f} ({row[m][1]:.2f})" for m in mods))
        for m in mods:
            g = math.exp(sum(math.log(r[m][0]) for r in res.values()) / len(res))
            print(f"  {m:10s} geomean {g:.3f} = {g / gfix[best]:.3f}x best fixed, "
                  f"{g / gfix[rule]:.3f}x the bench's ({rule} {gfix[rule]:.3f}); worst prompt "
                  f"{min(r[m][0] for r in res.values()):.3f}, worst session "
                  f"{min(r[m][1] for r in res.values()):.3f} x plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
