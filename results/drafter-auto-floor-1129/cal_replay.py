"""Variants of the calibration (3771ea2's engine/chooser.py `calibration`, reverted since;
issue 44) in text_replay.py's replay of the real answers: main; the calibration for every
candidate, uncapped ("cal"); it cut to some candidates, capped at 1, or with another
CAL_PRIOR ("free<=1" is 3771ea2's). Per prompt auto's speedup over plain, then each
variant's geomean, and over retrieval+ngram's (the best fixed drafter of both days).

  python results/drafter-auto-floor-1129/cal_replay.py [--seeds 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from text_replay import day, load_chooser  # noqa: E402

FREE = ("ngram", "retrieval", "retrieval+ngram")
CAL = "3771ea2"  # the calibration (free candidates, at most 1; reverted since)


def calibrated_all(tag: str, **consts):
    """3771ea2's chooser with its calibration for every drafter, uncapped (as first written;
    the variants below cut it back)."""
    src = subprocess.run(["git", "-C", str(HERE), "show", f"{CAL}:macfleet/engine/chooser.py"],
                         check=True, capture_output=True, text=True).stdout
    for a, b in (("return min(1.0, (CAL_PRIOR + e.realized) / (CAL_PRIOR + e.expected))",
                  "return (CAL_PRIOR + e.realized) / (CAL_PRIOR + e.expected)"),
                 ("last.why == BEST and self.by_name(name).free",
                  "last.why == BEST and name != PLAIN")):
        assert src.count(a) == 1, a
        src = src.replace(a, b)
    path = Path(tempfile.mkdtemp()) / f"chooser_calall{tag}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    for k, v in consts.items():
        setattr(mod, k, v)
    return mod


def variant(tag: str, only=None, cap: float | None = None, **consts):
    mod = calibrated_all(tag, **consts)
    orig = mod.Chooser.calibration

    def calibration(self, name):
        if only is not None and not only(name):
            return 1.0
        c = orig(self, name)
        return min(c, cap) if cap is not None else c
    mod.Chooser.calibration = calibration
    return mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args()
    pos = json.loads((HERE / "positions.json").read_text())
    mods = {"main": load_chooser("main"), "cal": calibrated_all(""),
            "cal<=1": variant("_a", cap=1.0),
            "free": variant("_b", only=lambda n: n in FREE),
            "notfree": variant("_c", only=lambda n: n not in FREE),
            "free<=1": variant("_g", only=lambda n: n in FREE, cap=1.0),
            "rn,r<=1": variant("_h", only=lambda n: n in FREE[1:], cap=1.0),
            "e2rn": variant("_d", only=lambda n: n == "eagle2+retrieval+ngram"),
            "prior8": calibrated_all("_e", CAL_PRIOR=8.0),
            "prior2": calibrated_all("_f", CAL_PRIOR=2.0)}
    for d in ("fast-prior", "slow-prior"):
        res = day(d, pos, mods, args.seeds)
        fix = math.exp(sum(math.log(r["fixed"]["retrieval+ngram"]) for r in res.values())
                       / len(res))
        print(f"## {d} ({len(res)} prompts): auto over plain per prompt; last rows: geomean, "
              f"over retrieval+ngram's")
        print(f"{'prompt':16s}" + "".join(f"{m:>9s}" for m in mods))
        for kind, row in res.items():
            print(f"{kind:16s}" + "".join(f"{row[m][0]:9.3f}" for m in mods))
        g = {m: math.exp(sum(math.log(r[m][0]) for r in res.values()) / len(res)) for m in mods}
        print(f"{'geomean':16s}" + "".join(f"{g[m]:9.3f}" for m in mods))
        print(f"{'/ best fixed':16s}" + "".join(f"{g[m] / fix:9.3f}" for m in mods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
