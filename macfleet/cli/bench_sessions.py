"""`macfleet bench sessions`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations


def add_bench_parsers(bs) -> None:
    s = bs.add_parser("sessions", help="one proposer agent serving N verifier sessions at once "
                      "vs each alone (results/sessions.json)")
    s.add_argument("--sessions", type=int, default=4, help="verifier sessions at once")
    s.add_argument("--max-tokens", type=int, default=32, help="answer length cap, in tokens")
    s.add_argument("--proposer", default="layerskip:20", help="the proposer agent's drafter")
    s.set_defaults(func=run_sessions)


def run_sessions(args) -> int:
    from macfleet.bench.record import write_result
    from macfleet.bench.sessions import bench_sessions

    from macfleet.cli.common import bench_runs

    with bench_runs("sessions") as say:
        res = bench_sessions(model=args.model, sessions=args.sessions,
                             max_tokens=args.max_tokens, spec=args.proposer, progress=say)
    path = write_result("sessions.json", res, args.out)
    print(f"{'session':>7s} {'alone tok/s':>12s} {'at once tok/s':>14s} {'slowdown':>9s}")
    for a, c, s in zip(res["alone"], res["concurrent"], res["slowdown_per_session"]):
        print(f"{a['session']:>7d} {a['tokens_per_s']:12.2f} {c['tokens_per_s']:14.2f} {s:8.2f}x")
    ag, fa = res["aggregate"], res["fairness_concurrent"]
    print(f"aggregate: {ag['concurrent_tokens_per_s']:.2f} tok/s at once vs "
          f"{ag['sequential_tokens_per_s']:.2f} one after another (x{ag['speedup_vs_sequential']})")
    print(f"fairness: min/max {fa['min_over_max']} (min {fa['min_tokens_per_s']}, max "
          f"{fa['max_tokens_per_s']} tok/s), Jain {fa['jain_index']}")
    print(f"note: {res['processes']} agent processes share {res['cpu_cores']} cores here")
    print(f"wrote {path}")
    return 0
