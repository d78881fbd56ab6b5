"""`macfleet bench ...`: measurements written to results/ (not timed tests)."""

from __future__ import annotations

import sys
from pathlib import Path

from macfleet.cli.common import add_key_args


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks written to results/")
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="directory the result files are written to")
    p.add_argument("--model", default="smollm2", help="the verifier's model spec")
    p.add_argument("--fleet", action="store_true", help="every discovered agent measures itself "
                   "(tool plane) into results/<host>/; `macfleet plan` reads these profiles")
    add_key_args(p)
    p.add_argument("--wait", type=float, default=2.0, help="--fleet: seconds to look for agents")
    p.set_defaults(func=run_fleet_profile)
    bs = p.add_subparsers(dest="bench", required=False, metavar="BENCH")
    v = bs.add_parser("verify-sweep", help="verify(L) for L=1..32 at two context lengths")
    v.add_argument("--repeats", type=int, default=5, help="timed forwards per point")
    v.set_defaults(func=run_verify_sweep)
    loc = bs.add_parser("local", help="mlx-lm vs macfleet proposers, one process")
    loc.add_argument("--max-tokens", type=int, default=64, help="answer length cap, in tokens")
    loc.add_argument("--repeats", type=int, default=2, help="runs of each method per prompt")
    loc.add_argument("--layerskip", type=int, default=20,
                     help="the layer the layerskip drafter exits at")
    loc.set_defaults(func=run_local)
    fm = bs.add_parser("fastmath", help="the CPU's exp/SiLU/softmax vs MLX's own ops, "
                       "interleaved (results/fastmath.json)")
    fm.add_argument("--repeats", type=int, default=12,
                    help="interleaved timed rounds (the first two are warm-up)")
    fm.set_defaults(func=run_fastmath)
    for mod in _extensions():
        mod.add_bench_parsers(bs)


def _extensions() -> list:
    """Benchmarks that live with the features they measure (fleet, f3, topologies, soak)."""
    import importlib

    mods = []
    for name in ("macfleet.cli.bench_fleet", "macfleet.cli.bench_soak", "macfleet.cli.bench_f3",
                 "macfleet.cli.bench_sessions", "macfleet.cli.bench_topologies",
                 "macfleet.cli.bench_drafter", "macfleet.cli.bench_serve",
                 "macfleet.cli.bench_moe", "macfleet.cli.bench_disagg",
                 "macfleet.cli.bench_overhead", "macfleet.cli.bench_pair_dial",
                 "macfleet.cli.bench_pair", "macfleet.cli.bench_unseen"):
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    return mods


def run_fleet_profile(args) -> int:
    from macfleet.cli.common import UserError, fleet_key
    from macfleet.fleet.client import members
    from macfleet.fleet.profile import profile_fleet

    if not args.fleet:
        raise UserError("name a benchmark (macfleet bench --help) or use --fleet")
    key = fleet_key(args)
    cards = members(key, wait_s=args.wait)
    if not cards:
        raise UserError("no agents discovered: run `macfleet agent --role verifier|proposer` "
                        "(or `macfleet service install`) on each Mac, `macfleet up` for a "
                        "fleet on this one; or check the fleet key")
    written = profile_fleet(cards, key, args.out, progress)
    for host, files in sorted(written.items()):
        print(f"{host}: {len(files)} profile(s) in {Path(files[0]).parent}")
    return 0 if written else 1


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_verify_sweep(args) -> int:
    from macfleet.bench.record import write_result
    from macfleet.engine.verify_costs import SWEEP_CONTEXTS, SWEEP_LENGTHS, verify_sweep
    from macfleet.cli.common import bench_runs, load_model

    lm = load_model(args.model)
    with bench_runs("verify-sweep", len(SWEEP_CONTEXTS) * len(SWEEP_LENGTHS)) as say:
        res = verify_sweep(lm, repeats=args.repeats, progress=say)
    path = write_result("verify_l_sweep.json", res, args.out)
    for c in res["curves"]:
        pts = {p["L"]: p["ratio_to_L1"] for p in c["points"]}
        print(f"context {c['context']}: verify(L)/verify(1): L=4 {pts[4]}, L=8 {pts[8]}, "
              f"L=16 {pts[16]}, L=32 {pts[32]} (verify(1) = {c['points'][0]['ms']} ms)")
    print(f"wrote {path}")
    return 0


def run_fastmath(args) -> int:
    from macfleet.bench.fastmath import bench_fastmath
    from macfleet.bench.record import write_result
    from macfleet.cli.common import UserError, bench_runs, load_model

    if args.repeats < 3:
        raise UserError("--repeats must be >= 3 (the first two are warm-up)")
    lm = load_model(args.model)
    try:
        with bench_runs("fastmath") as say:
            res = bench_fastmath(lm, repeats=args.repeats, progress=say)
    except ValueError as e:
        raise UserError(str(e)) from None
    path = write_result("fastmath.json", res, args.out)
    print(f"wrote {path}")
    return 0


def run_local(args) -> int:
    from macfleet.bench.local import N_METHODS, bench_local
    from macfleet.bench.prompts import BENCH_PROMPTS
    from macfleet.bench.record import write_result
    from macfleet.cli.common import bench_runs, load_model

    lm = load_model(args.model)
    with bench_runs("local", len(BENCH_PROMPTS) * args.repeats * N_METHODS) as say:
        res = bench_local(lm, BENCH_PROMPTS, max_tokens=args.max_tokens,
                          repeats=args.repeats, layerskip=args.layerskip, progress=say)
    path = write_result("local_spec.json", res, args.out)
    for pname, r in res["prompts"].items():
        print(f"{pname}:")
        for m, v in r["methods"].items():
            print(f"  {m:40s} {v['tokens_per_s']:6.1f} tok/s  x{v['ratio_to_mlx_generate_step']:.2f}"
                  f" vs plain  x{v['ratio_to_mlx_speculative']:.2f} vs mlx spec")
    print(f"wrote {path}")
    return 0
