"""CPU seconds per answer of an ab_real.py / ab_backoff.py --out file, per prompt and variant
(every run, the mean), and each variant's mean over plain's mean.

  python results/drafter-auto-floor-1129/ab_summary.py ab_cal_1.json [more.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys


def main() -> int:
    runs: dict = {}
    for f in sys.argv[1:]:
        for kind, by in json.load(open(f)).items():
            for v, rows in by.items():
                runs.setdefault(kind, {}).setdefault(v, []).extend(r["cpu_s"] for r in rows)
    for kind, by in runs.items():
        plain = statistics.mean(by["none"])
        cells = []
        for v, xs in by.items():
            cells.append(f"{v} {'/'.join(f'{x:.1f}' for x in xs)} mean {statistics.mean(xs):.2f}"
                         + ("" if v == "none" else f" ({plain / statistics.mean(xs):.2f}x)"))
        print(f"{kind:11s} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
