"""Install the packed wheels (.gpu/w) whose packages the machine's Python lacks.

    python3 .ci/gpu/wheels.py DIR TARGET

A wheel is skipped when every top-level package it holds already imports (the machine's own
versions are kept: its torch or transformers may pin them); the others go into TARGET with
pip --no-index --no-deps. Prints what it installed and what it kept.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path


def top_level(wheel: Path) -> set[str]:
    """The importable top-level names a wheel installs (from its file list)."""
    names = set()
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            head = n.split("/", 1)[0]
            if head.endswith((".dist-info", ".data", ".libs")) or head.startswith("_"):
                continue
            names.add(head[:-3] if head.endswith(".py") else head.split(".", 1)[0])
    return names


def main(src: str, target: str) -> int:
    want, kept = [], []
    for whl in sorted(Path(src).glob("*.whl")):
        names = top_level(whl)
        if names and all(importlib.util.find_spec(n) is not None for n in names):
            kept.append(whl.name.split("-")[0])
        else:
            want.append(whl)
    print(f"wheels: the machine has {', '.join(kept) or 'none'}; installing "
          f"{', '.join(w.name.split('-')[0] for w in want) or 'none'}")
    if not want:
        return 0
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                            "--no-deps", "--no-compile", "--target", target,
                            *map(str, want)])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
