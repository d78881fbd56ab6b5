"""`macfleet bench topologies`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations


def add_bench_parsers(bs) -> None:
    t = bs.add_parser("topologies", help="planner prediction vs measured tokens/s per runnable "
                      "topology (results/topologies.json)")
    t.add_argument("--max-tokens", type=int, default=32, help="answer length cap, in tokens")
    t.add_argument("--layerskip", type=int, default=20,
                   help="the layer the layerskip drafter exits at")
    t.add_argument("--prompt", default="summary", help="a name in macfleet.bench.prompts")
    t.add_argument("--only", default="",
                   help="comma-separated substrings of case names (default: every case)")
    t.set_defaults(func=run_topologies)


def run_topologies(args) -> int:
    from macfleet.bench.prompts import BENCH_PROMPTS
    from macfleet.bench.record import write_result
    from macfleet.bench.topologies import bench_topologies
    from macfleet.cli.common import bench_runs, load_model
    from macfleet.topology.inputs import measured_profile

    lm = load_model(args.model)
    with bench_runs("topologies") as say:
        res = bench_topologies(lm, BENCH_PROMPTS.get(args.prompt, args.prompt),
                               profile=measured_profile(args.out), results=args.out,
                               max_tokens=args.max_tokens, layerskip=args.layerskip,
                               only=[o for o in args.only.split(",") if o], progress=say)
    path = write_result("topologies.json", res, args.out)
    print(f"{'topology':36s} {'predicted':>10s} {'measured':>9s} {'error':>8s}  tok/s")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['case']:36s} failed: {r['error'][:200]}")
            continue
        pred = "-" if r["predicted_tokens_per_s"] is None else f"{r['predicted_tokens_per_s']:.1f}"
        err = "-" if r["error_pct"] is None else f"{r['error_pct']:+.0f}%"
        print(f"{r['case']:36s} {pred:>10s} {r['measured_tokens_per_s']:9.1f} {err:>8s}")
    print(f"profile: {res['profile_source']}")
    print(f"wrote {path}")
    return 0
