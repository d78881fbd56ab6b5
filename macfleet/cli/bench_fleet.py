"""`macfleet bench fleet`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations


def add_bench_parsers(bs) -> None:
    f = bs.add_parser("fleet", help="one process vs two agent processes (results/fleet_spec.json)")
    f.add_argument("--max-tokens", type=int, default=48, help="answer length cap, in tokens")
    f.add_argument("--repeats", type=int, default=2, help="runs of each method per prompt")
    f.add_argument("--layerskip", type=int, default=20,
                   help="the layer the in-process layerskip drafter exits at")
    f.add_argument("--proposer", default="ngram,layerskip:20", metavar="SPEC[,SPEC...]",
                   help="the remote proposer's drafters to compare, comma-separated")
    f.add_argument("--first-only", action="store_true", help="only the first request after "
                   "`up` on an empty cache against the same request warm (`first_request`)")
    f.set_defaults(func=run_fleet)


def run_fleet(args) -> int:
    from macfleet.bench.fleet import bench_fleet
    from macfleet.bench.prompts import BENCH_PROMPTS, NO_MATCH_PROMPT
    from macfleet.bench.record import write_result
    from macfleet.cli.common import bench_runs, load_model

    prompts = dict(BENCH_PROMPTS, no_match=NO_MATCH_PROMPT)
    lm = load_model(args.model)
    with bench_runs("fleet") as say:
        res = bench_fleet(lm, prompts, max_tokens=args.max_tokens,
                          repeats=args.repeats, layerskip=args.layerskip,
                          proposers=tuple(args.proposer.split(",")), progress=say,
                          first_only=args.first_only)
    path = write_result("fleet_first.json" if args.first_only else "fleet_spec.json", res,
                        args.out)
    fr = res["first_request"]
    print(f"first request after up ({fr['proposer']}, empty cache): "
          f"{fr['first']['tokens_per_s']:.1f} tok/s, warm {fr['warm_tokens_per_s']:.1f}: "
          f"x{fr['first_over_warm']:.2f} (prefill x{fr['prefill_ms_first_over_warm']:.2f})")
    for pname, r in res.get("prompts", {}).items():
        print(f"{pname}:")
        for m, v in r["methods"].items():
            oh = f" overhead {v['multihost_overhead']:.1%}" if "multihost_overhead" in v else ""
            print(f"  {m:42s} {v['tokens_per_s']:6.1f} tok/s  x{v['ratio_to_mlx_generate_step']:.2f}"
                  f" plain  x{v['ratio_to_agent_alone']:.2f} agent-alone{oh}")
    print(f"wrote {path}")
    return 0
