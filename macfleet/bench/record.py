"""Writing benchmark results: every file says what made it, where, and when."""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

DEFAULT_RESULTS = Path("results")


def environment() -> dict:
    import mlx.core as mx

    from macfleet import sysinfo

    return {
        "chip": sysinfo.chip(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": getattr(mx, "__version__", "?"),
        "device": str(mx.default_device()),
        "blas": sysinfo.blas_in_use(),
        "python": platform.python_version(),
    }


def write_result(name: str, payload: dict, out_dir: Path = DEFAULT_RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "macfleet " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
        **payload,
    }
    path = out_dir / name
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else 0.0
