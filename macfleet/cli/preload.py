"""Re-exec the CLI with OpenBLAS preloaded on Linux.

MLX's Linux CPU wheel links a slow reference BLAS; preloading OpenBLAS makes matmul ~30x faster
and verify(L) sublinear. LD_PRELOAD only works at process start, so the CLI re-executes itself
once (guarded by MACFLEET_PRELOADED). Agents started by the CLI inherit the environment.
Set MACFLEET_NO_OPENBLAS=1 to opt out.
"""

from __future__ import annotations

import os
import sys

from macfleet.sysinfo import find_openblas


def ensure_openblas() -> None:
    if sys.platform != "linux" or os.environ.get("MACFLEET_NO_OPENBLAS"):
        return
    if os.environ.get("MACFLEET_PRELOADED") or "libopenblas" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env["MACFLEET_PRELOADED"] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "macfleet", *sys.argv[1:]], env)
