"""`macfleet bench disagg`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import sys


def add_bench_parsers(bs) -> None:
    s = bs.add_parser("disagg", help="short sessions around a long prompt, with and without a "
                      "prefill agent (results/disagg.json)")
    s.add_argument("--prompt-tokens", type=int, default=2000)
    s.add_argument("--sessions", type=int, default=4, help="short sessions")
    s.add_argument("--max-tokens", type=int, default=32, help="per short session")
    s.add_argument("--codecs", default="auto", help="KV codecs to run with a prefill agent, "
                   "comma-separated (auto,float16,int8)")
    s.set_defaults(func=run_disagg)


def run_disagg(args) -> int:
    from macfleet.bench.disagg import bench_disagg
    from macfleet.bench.record import write_result

    res = bench_disagg(model=args.model, prompt_tokens=args.prompt_tokens, shorts=args.sessions,
                       short_tokens=args.max_tokens,
                       codecs=tuple(c for c in args.codecs.split(",") if c),
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    path = write_result("disagg.json", res, args.out)
    print(f"{'mode':24s} {'short TTFT p50/max s':>21s} {'short ITL p50/p99 s':>20s} "
          f"{'long TTFT s':>11s} {'KV MB':>7s} {'KV ms':>8s} identical")
    for m in res["modes"]:
        kv = m["kv"]
        print(f"{m['mode']:24s} {m['short_ttft_s']['p50']:>10.2f}/{m['short_ttft_s']['max']:<10.2f}"
              f" {m['short_itl_s']['p50']:>9.3f}/{m['short_itl_s']['p99']:<10.3f}"
              f" {m['long_ttft_s']:>11.2f} {kv.get('kv_bytes', 0) / 1e6:>7.1f}"
              f" {kv.get('kv_ms', 0):>8.0f} {m['long_ids_identical_to_verifier_alone']}")
    print(f"wrote {path}")
    return 0
