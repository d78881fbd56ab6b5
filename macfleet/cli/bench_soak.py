"""`macfleet bench soak`: registered into `macfleet bench` by cmd_bench (results/soak.json)."""

from __future__ import annotations


def add_bench_parsers(bs) -> None:
    s = bs.add_parser("soak", help="N short generations on a local fleet: no failures, RSS "
                      "growth < 5 %%, no fd leak (results/soak.json)")
    s.add_argument("--requests", type=int, default=1000, help="generations in all")
    s.add_argument("--warmup", type=int, default=20,
                   help="generations before the memory baseline is taken")
    s.add_argument("--max-tokens", type=int, default=4, help="answer length cap, in tokens")
    s.add_argument("--proposer", default="ngram", help="the remote proposer's drafter")
    s.set_defaults(func=run_soak)


def run_soak(args) -> int:
    from macfleet.bench.record import write_result
    from macfleet.bench.soak import soak

    from macfleet.cli.common import bench_runs

    with bench_runs("soak") as say:
        res = soak(model=args.model, requests=args.requests, warmup=args.warmup,
                   max_tokens=args.max_tokens, spec=args.proposer, progress=say)
    path = write_result("soak.json", res, args.out)
    for name, a in res["agents"].items():
        print(f"{name:12s} RSS {a['rss_before'] / 2**20:7.1f} -> {a['rss_after'] / 2**20:7.1f} MiB"
              f" ({a['rss_growth']:+.2%})  fds {a['fds_before']} -> {a['fds_after']}")
    print(f"{res['requests']} requests in {res['wall_s']} s ({res['requests_per_s']}/s, p50 "
          f"{res['latency_p50_ms']} ms, p99 {res['latency_p99_ms']} ms), "
          f"{res['failures']} failures: {'PASS' if res['pass'] else 'FAIL'}")
    print(f"wrote {path}")
    return 0 if res["pass"] else 1
