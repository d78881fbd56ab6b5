"""Where a test run's minutes go: reads pytest's `--durations=0` report (a saved log, or
several: an xdist pass and the serial pass) and prints markdown tables by directory and by
file (setup, call, teardown), and the slowest setups (a fixture that starts a server, a fleet
or loads a model bills its time to the setup of the first test that asks for it).

    .venv/bin/python -m pytest --durations=0 ... | tee run.log
    python .ci/durations.py run.log [more.log ...] [--top 25]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def read(paths: list[Path]) -> list[tuple[float, str, str]]:
    rows = []
    for p in paths:
        for line in p.read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                rows.append((float(m.group(1)), m.group(2), m.group(3)))
    return rows


def table(rows, key, top: int) -> list[str]:
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tests: dict[str, set[str]] = defaultdict(set)
    for s, phase, nodeid in rows:
        k = key(nodeid)
        acc[k][phase] += s
        tests[k].add(nodeid)
    total = sum(s for s, _, _ in rows) or 1.0
    out = ["| where | tests (>= 5 ms) | setup s | call s | teardown s | total s | share |",
           "|---|---|---|---|---|---|---|"]
    for k, ph in sorted(acc.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        t = sum(ph.values())
        out.append(f"| {k} | {len(tests[k])} | {ph['setup']:.0f} | {ph['call']:.0f} | "
                   f"{ph['teardown']:.0f} | {t:.0f} | {100 * t / total:.1f}% |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    rows = read(a.logs)
    if not rows:
        print("no --durations lines found (run pytest with --durations=0)", file=sys.stderr)
        return 1
    total = sum(s for s, _, _ in rows)
    print(f"{len({n for _, _, n in rows})} tests, {total:.0f} s summed over tests "
          f"(setup {sum(s for s, p, _ in rows if p == 'setup'):.0f} s)\n")
    print("By directory\n")
    print("\n".join(table(rows, lambda n: n.split("::")[0].rsplit("/", 1)[0], a.top)))
    print("\nBy file\n")
    print("\n".join(table(rows, lambda n: n.split("::")[0], a.top)))
    print("\nSlowest setups (a module or session fixture's start, billed to its first test)\n")
    print("| setup s | test |\n|---|---|")
    for s, _, n in sorted((r for r in rows if r[1] == "setup"), reverse=True)[:a.top]:
        print(f"| {s:.1f} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
