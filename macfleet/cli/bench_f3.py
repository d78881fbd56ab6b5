"""`macfleet bench f3`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import sys


def add_bench_parsers(bs) -> None:
    f = bs.add_parser("f3", help="F3 hidden-state wire cost per payload size and link "
                      "(results/f3_overhead.json + .png)")
    f.add_argument("--repeats", type=int, default=10)
    f.add_argument("--max-mib", type=int, default=16, help="largest payload (MiB, power of 4)")
    f.add_argument("--no-netns", action="store_true", help="loopback only")
    f.set_defaults(func=run_f3)


def run_f3(args) -> int:
    from macfleet.bench.f3 import DEFAULT_SIZES, bench_f3, plot
    from macfleet.bench.record import write_result

    sizes = tuple(s for s in DEFAULT_SIZES if s <= args.max_mib * 1024 * 1024)
    res = bench_f3(sizes=sizes, repeats=args.repeats, netns=not args.no_netns,
                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    path = write_result("f3_overhead.json", res, args.out)
    png = plot(res, args.out / "f3_overhead.png")
    links = list(res["links"])
    print(f"{'payload':>10s}  " + "  ".join(f"{ln + ' med/p95 ms':>26s}" for ln in links))
    for i, p in enumerate(res["links"][links[0]]):
        row = "  ".join(f"{res['links'][ln][i]['median_ms']:12.3f} {res['links'][ln][i]['p95_ms']:12.3f} "
                        for ln in links)
        print(f"{p['nbytes']:>10d}  {row}")
    print("real F3 payloads per block (ms interpolated from medians):")
    for r in res["real_payloads"]:
        if r["tokens"] in (1, 4):
            ms = "  ".join(f"{ln} {v:8.3f}" for ln, v in r["ms"].items())
            print(f"  {r['verifier']:18s} {r['drafter']:8s} {r['tokens']} tok {r['nbytes']:>8d} B"
                  f"  {ms}")
    for ln, why in res["skipped_links"].items():
        print(f"skipped {ln}: {why}")
    print(f"wrote {path}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    return 0
