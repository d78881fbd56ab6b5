"""`macfleet bench f3`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import sys


def add_bench_parsers(bs) -> None:
    f = bs.add_parser("f3", help="F3 hidden-state wire cost per payload size and link "
                      "(results/f3_overhead.json + .png)")
    f.add_argument("--repeats", type=int, default=10)
    f.add_argument("--max-mib", type=int, default=16, help="largest payload (MiB, power of 4)")
    f.add_argument("--no-netns", action="store_true", help="loopback only")
    f.add_argument("--encryption", action="store_true", help="instead: open vs closed (CURVE) "
                   "fleet per payload size and SmolLM2 flow -> results/security.json")
    f.set_defaults(func=run_f3)
    s = bs.add_parser("security", help="closed-fleet cost (open vs CURVE) and a fuzz campaign "
                      "against live agents (results/security.json)")
    s.add_argument("--repeats", type=int, default=10)
    s.add_argument("--max-mib", type=int, default=16, help="largest payload (MiB, power of 4)")
    s.add_argument("--messages", type=int, default=3000, help="fuzz messages in all")
    s.add_argument("--skip-encryption", action="store_true")
    s.add_argument("--skip-fuzz", action="store_true")
    s.set_defaults(func=run_security)


def _update_security(out, section: dict):
    """results/security.json keeps the other section when one is re-run."""
    import json

    from macfleet.bench.record import write_result

    path = out / "security.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    keep = {k: v for k, v in old.items() if k in ("encryption", "fuzz") and k not in section}
    commands = {**old.get("commands", {}), **{k: " ".join(["macfleet", *sys.argv[1:]])
                                                for k in section}}
    return write_result("security.json", {**keep, **section, "commands": commands}, out)


def run_security(args, *, fuzz: bool | None = None, encryption: bool | None = None) -> int:
    sizes = _sizes(args.max_mib)
    section: dict = {}
    if not getattr(args, "skip_encryption", False) and encryption is not False:
        from macfleet.bench.security import encryption_cost

        res = section["encryption"] = encryption_cost(sizes=sizes, repeats=args.repeats,
                                                      results=args.out, progress=_progress)
        print(f"{'payload':>10s} {'open ms':>9s} {'closed ms':>9s} {'extra':>8s} {'+hmac':>7s}")
        for r in res["by_size"]:
            print(f"{r['nbytes']:>10d} {r['open_ms']:9.3f} {r['closed_ms']:9.3f} "
                  f"{r['extra_ms']:8.3f} {r['hmac_ms']:7.3f}")
        print(f"per SmolLM2 block ({res['block_ms']} ms, {res['block_ms_source']}):")
        for f in res["smollm2_flows"]:
            print(f"  {f['flow']:3s} {f['nbytes']:>9d} B  +{f['extra_ms']:7.3f} ms  "
                  f"{100 * f['share_of_block']:6.2f}%  {f['what']}")
    if not getattr(args, "skip_fuzz", False) and fuzz is not False:
        from macfleet.bench.fuzz import campaign

        res = section["fuzz"] = campaign(messages=args.messages, progress=_progress)
        for door, d in res["doors"].items():
            print(f"{door:10s} {d['messages']:6d} msgs  crashes {d['crashes']}  hangs {d['hangs']}"
                  f"  rss {d['rss_before_mib']} -> {d['rss_after_mib']} MiB  refusals "
                  f"{d['refusals']}")
        for case, f in res["faults"].items():
            print(f"fault {case}: {f['outcome'][:80]} after {f['seconds_after_fault']} s")
    path = _update_security(args.out, section)
    print(f"wrote {path}")
    return 0


def _sizes(max_mib: int) -> tuple[int, ...]:
    from macfleet.bench.f3 import DEFAULT_SIZES

    return tuple(s for s in DEFAULT_SIZES if s <= max_mib * 1024 * 1024)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_f3(args) -> int:
    if args.encryption:
        return run_security(args, fuzz=False)
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
