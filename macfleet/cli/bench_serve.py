"""`macfleet bench serve`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import sys


def add_bench_parsers(bs) -> None:
    s = bs.add_parser("serve", help="streaming clients against `macfleet serve`: tokens/s, TTFT, "
                      "inter-token latency; decode stall under a long prompt (results/serve.json)")
    s.add_argument("--clients", default="1,4,8,16", help="comma-separated client counts")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--time-limit", type=float, default=900.0, help="seconds for everything")
    s.add_argument("--no-stall", action="store_true", help="skip the decode-stall measurement")
    s.set_defaults(func=run_serve)


def run_serve(args) -> int:
    from macfleet.bench.record import write_result
    from macfleet.bench.serve import bench_serve, plot, summary_rows
    from macfleet.cli.main import UserError

    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--clients must be numbers separated by commas, got {args.clients}")
    if not clients or min(clients) < 1 or args.max_tokens < 1:
        raise UserError("--clients and --max-tokens must be >= 1")
    res = bench_serve(args.model, clients, args.max_tokens, args.time_limit,
                      lambda m: print(m, file=sys.stderr, flush=True), stall=not args.no_stall)
    path = write_result("serve.json", res, args.out)
    if plot(res, args.out / "serve.png"):
        print(f"wrote {args.out / 'serve.png'}")
    for line in summary_rows(res):
        print(line)
    print(f"wrote {path}")
    return 0
