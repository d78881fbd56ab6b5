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


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None when matplotlib is missing
    (`pip install 'macfleet[bench]'`): a bench still writes its JSON without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_log_x_plot(plt, fig, ax, out: Path) -> Path:
    """The finish every learning-curve plot shares: grid, legend, a PNG at `out`."""
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
