"""`macfleet bench moe`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations


def add_bench_parsers(bs) -> None:
    m = bs.add_parser("moe", help="expert vs tensor vs pipeline parallelism of the tiny MoE over "
                      "2 and 4 shard ranks, measured and predicted (results/moe.json)")
    m.add_argument("--ranks", default="2,4", help="ring sizes, comma-separated")
    m.add_argument("--max-tokens", type=int, default=16, help="answer length cap, in tokens")
    m.add_argument("--repeats", type=int, default=5,
                   help="runs per mode (interleaved; the median counts)")
    m.set_defaults(func=run_moe)


def run_moe(args) -> int:
    from macfleet.bench.moe import bench_moe
    from macfleet.bench.record import write_result

    model = args.model if args.model.startswith("tiny-moe") else "tiny-moe:1"
    from macfleet.cli.common import bench_runs

    with bench_runs("moe") as say:
        res = bench_moe(model, sizes=tuple(int(n) for n in args.ranks.split(",") if n),
                        tokens=args.max_tokens, repeats=args.repeats, progress=say)
    path = write_result("moe.json", res, args.out)
    print(f"{'ranks':>5s} {'mode':8s} {'tok/s':>7s} {'predicted':>9s} {'B/forward':>9s} "
          f"{'predicted':>9s} {'ms/forward':>10s}  ids")
    for r in res["rows"]:
        if "mode" not in r:
            print(f"{r['ranks']:>5d} ranking measured {r['measured_ranking']} predicted "
                  f"{r['predicted_ranking']} ({'match' if r['ranking_matches'] else 'differ'})")
            continue
        print(f"{r['ranks']:>5d} {r['mode']:8s} {r['measured_tokens_per_s']:7.1f} "
              f"{r['predicted_tokens_per_s']:9.1f} {r['bytes_per_decode_forward']:9.0f} "
              f"{r['predicted_bytes_per_decode_forward']:9d} "
              f"{r['measured_ms_per_decode_forward']:10.2f}  "
              f"{'same' if r['ids_match'] else 'DIFFER'}")
    print(f"wrote {path}")
    return 0
