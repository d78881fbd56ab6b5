"""`macfleet bench pair-dial`: the pair verifier's dial settings and cost ratio
(results/pair_dial.json); registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import shlex
import shutil
import sys
import time


def add_bench_parsers(bs) -> None:
    p = bs.add_parser(
        "pair-dial", help="the instrument of `bench pair`: eps of the wide SmolLM2 verifier for "
        "each target acceptance of the SmolLM2 draft, and c = draft token / verify(1) on one "
        "core (results/pair_dial.json)")
    p.add_argument("--parts", default="dial,cost",
                   help="dial (calibrate the verifier's eps), draft (calibrate the draft dial: "
                   "the draft's weight noise against an eps-0 verifier), cost (time draft and "
                   "verifier on one core); each part updates its own entry of the file")
    p.add_argument("--targets", default="0.6,0.8,0.95", help="target per-token acceptances")
    p.add_argument("--extra-layers", type=int, default=None, help="extra decoder layers "
                   "(default: pair_model.DEFAULT_EXTRA_LAYERS)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-weight pair models")
    p.add_argument("--prompts", type=int, default=6, metavar="N",
                   help="the first N calibration prompts (pair_dial.CALIBRATION_PROMPTS)")
    p.add_argument("--max-tokens", type=int, default=96,
                   help="verifier answer tokens per prompt")
    p.add_argument("--steps", type=int, default=5, help="bisection steps per target (at most)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="stop a target's bisection when acceptance is this near it")
    p.add_argument("--eps-range", default="0.01,1.0",
                   help="the bisection's eps bracket (its geometric middle is the first guess)")
    p.add_argument("--noise-range", default="0.02,0.3",
                   help="the draft dial's bisection bracket (weight noise / the matrix's RMS)")
    p.add_argument("--widths", default="6144,auto",
                   help="verifier widths the cost part times; auto: the width whose bytes give "
                   "c = --target-c, corrected by the first width's measured c")
    p.add_argument("--target-c", type=float, default=0.15,
                   help="the draft/verify cost ratio `auto` widths aim at")
    p.add_argument("--core", type=int, default=0, help="the core the cost part pins to")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per length (fastest kept)")
    p.add_argument("--keep", action="store_true", help="keep the verifiers the cost part built")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _dial(args, extra: int) -> dict:
    from macfleet.bench.pair_dial import CALIBRATION_PROMPTS, calibrate

    lo, hi = (float(x) for x in args.eps_range.split(","))
    seen: dict[float, float] = {}
    settings = []
    for t in (float(x) for x in args.targets.split(",")):
        s = calibrate(1536, t, extra_layers=extra, seed=args.seed,
                      prompts=CALIBRATION_PROMPTS[: args.prompts], tokens=args.max_tokens,
                      steps=args.steps, eps_range=(lo, hi), seen=seen,
                      tolerance=args.tolerance, progress=_log)
        _log(f"target {t}: eps {s.eps:.4g}, acceptance {s.acceptance:.3f}")
        settings.append({"target": t, "eps": s.eps, "acceptance": round(s.acceptance, 4)})
    return {"extra_layers": extra, "seed": args.seed, "calibration_width": 1536,
            "prompts": list(CALIBRATION_PROMPTS[: args.prompts]), "tokens": args.max_tokens,
            "settings": settings,
            "measured": [{"eps": e, "acceptance": round(a, 4)} for e, a in sorted(seen.items())]}


def _draft_dial(args) -> dict:
    from macfleet.bench.pair_dial import CALIBRATION_PROMPTS, calibrate_draft

    lo, hi = (float(x) for x in args.noise_range.split(","))
    seen: dict[float, float] = {}
    settings = []
    for t in (float(x) for x in args.targets.split(",")):
        s = calibrate_draft(t, seed=args.seed, prompts=CALIBRATION_PROMPTS[: args.prompts],
                            tokens=args.max_tokens, steps=args.steps, noise_range=(lo, hi),
                            seen=seen, tolerance=args.tolerance, progress=_log)
        _log(f"target {t}: draft noise {s.eps:.4g}, acceptance {s.acceptance:.3f}")
        settings.append({"target": t, "noise": s.eps, "acceptance": round(s.acceptance, 4)})
    return {"seed": args.seed, "prompts": list(CALIBRATION_PROMPTS[: args.prompts]),
            "tokens": args.max_tokens, "settings": settings,
            "measured": [{"noise": e, "acceptance": round(a, 4)} for e, a in sorted(seen.items())]}


def _cost(args, extra: int) -> dict:
    from dataclasses import asdict

    from macfleet.bench.pair_dial import cost_ratio
    from macfleet.bench.pair_model import (build_pair_verifier, param_bytes, pair_dir,
                                           weights_and_config, width_for_bytes)
    from macfleet.engine.models import load_model

    rows = []
    for w in args.widths.split(","):
        if w == "auto":  # bytes predict c on a quiet box (6144: 0.38 by bytes, 0.39 timed)
            cfg = weights_and_config(load_model("smollm2:dense").model)[1]
            width = width_for_bytes(cfg, param_bytes(cfg) / args.target_c, extra)
        else:
            width = int(w)
        t0 = time.perf_counter()
        path = build_pair_verifier(width, extra, 0.0, args.seed)
        built = time.perf_counter() - t0
        r = cost_ratio(path, core=args.core, reps=args.repeats)
        row = {**asdict(r), "verify_ms": {str(k): v for k, v in r.verify_ms.items()},
               "verify_cpu_ms": {str(k): v for k, v in r.verify_cpu_ms.items()},
               "build_s": round(built, 1), "auto": w == "auto"}
        _log(f"width {width}: {row}")
        rows.append(row)
        if not args.keep:
            shutil.rmtree(pair_dir(width, extra, 0.0, args.seed), ignore_errors=True)
    return {"core": args.core, "context": 128, "reps": args.repeats, "target_c": args.target_c,
            "widths": rows,
            "note": "fastest of reps, one pinned core of a loaded shared box: ratios only"}


def merge_dial(old: dict | None, new: dict, knob: str = "eps") -> dict:
    """One dial entry from runs of the same instrument (extra layers, seed, prompts, tokens)
    that calibrated different targets: their measured points together, and for each target
    the measured setting of `knob` (eps, or the draft dial's noise) whose acceptance is
    nearest it (any run's point serves every target)."""
    same = ("extra_layers", "seed", "calibration_width", "prompts", "tokens")
    if not old or any(old.get(k) != new.get(k) for k in same):
        return new
    measured = {m[knob]: m for m in old.get("measured", [])}
    measured.update({m[knob]: m for m in new["measured"]})
    targets = sorted({s["target"] for s in [*old.get("settings", []), *new["settings"]]})
    settings = []
    for t in targets:
        best = min(measured.values(), key=lambda m: abs(m["acceptance"] - t))
        settings.append({"target": t, knob: best[knob], "acceptance": best["acceptance"]})
    return {**new, "settings": settings, "measured": [measured[e] for e in sorted(measured)]}


def run(args) -> int:
    import json
    from pathlib import Path

    from macfleet.bench.pair_model import DEFAULT_EXTRA_LAYERS
    from macfleet.bench.record import write_result

    extra = DEFAULT_EXTRA_LAYERS if args.extra_layers is None else args.extra_layers
    parts = set(args.parts.split(","))
    if not parts <= {"dial", "draft", "cost"}:
        raise SystemExit(f"--parts: dial, draft and/or cost, not {args.parts}")
    got = {}
    if "dial" in parts:
        got["dial"] = _dial(args, extra)
    if "draft" in parts:
        got["draft_dial"] = _draft_dial(args)
    if "cost" in parts:
        got["cost"] = _cost(args, extra)
    old = args.out / "pair_dial.json"
    doc = json.loads(old.read_text()) if old.is_file() else {}
    keep = {k: doc[k] for k in ("dial", "draft_dial", "cost") if k in doc and k not in got}
    commands = doc.get("commands", {})
    this = "macfleet " + shlex.join(sys.argv[1:])
    if "dial" in got:
        merged = merge_dial(doc.get("dial"), got["dial"])
        commands["dial"] = (commands.get("dial", []) if merged is not got["dial"] else []) + [this]
        got["dial"] = merged
    if "draft_dial" in got:
        merged = merge_dial(doc.get("draft_dial"), got["draft_dial"], "noise")
        commands["draft_dial"] = (commands.get("draft_dial", [])
                                  if merged is not got["draft_dial"] else []) + [this]
        got["draft_dial"] = merged
    if "cost" in got:
        commands["cost"] = [this]
    path = write_result("pair_dial.json", {**keep, **got, "commands": commands}, Path(args.out))
    print(f"wrote {path}")
    return 0
