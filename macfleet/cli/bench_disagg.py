"""`macfleet bench disagg`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import sys


def add_bench_parsers(bs) -> None:
    s = bs.add_parser("disagg", help="sessions decoding while a long prompt arrives, with and "
                      "without a prefill agent (results/disagg.json)")
    s.add_argument("--prompt-tokens", default="2000,8000", help="long prompt sizes, "
                   "comma-separated")
    s.add_argument("--sessions", type=int, default=4, help="sessions already decoding")
    s.add_argument("--codecs", default="auto", help="KV codecs to run with a prefill agent, "
                   "comma-separated (auto,float16,int8)")
    s.add_argument("--links", default="loopback,netns-wifi", help="links to run the prefill "
                   "agent over, comma-separated (netns-wifi: two network namespaces with a "
                   "100 Mbit/s tbf; needs root, skipped otherwise)")
    s.add_argument("--stall-ratio", type=float, default=None, metavar="R",
                   help="the verifier agent's --stall-ratio (default: its own)")
    s.add_argument("--control-s", type=float, default=60.0, metavar="S",
                   help="also run the short sessions this long with no long prompt (the "
                   "workload's own spread, the yardstick of the goal; 0: skip)")
    s.add_argument("--busy-control", type=int, default=None, metavar="TOKENS",
                   help="also run them while the prefill agent computes a TOKENS-token "
                   "prompt's KV for the bench, not the verifier (its load on this machine "
                   "without any KV reaching the verifier; default: the largest prompt size; "
                   "0: skip)")
    s.set_defaults(func=run_disagg)


def run_disagg(args) -> int:
    from macfleet.bench.disagg import LINKS, bench_disagg, plot
    from macfleet.bench.record import write_result
    from macfleet.cli.common import UserError

    try:
        sizes = tuple(int(x) for x in args.prompt_tokens.split(",") if x)
    except ValueError:
        raise UserError("--prompt-tokens: comma-separated token counts") from None
    links = tuple(x for x in args.links.split(",") if x)
    if not links or any(x not in LINKS for x in links):
        raise UserError(f"--links: comma-separated, from {', '.join(LINKS)}")
    res = bench_disagg(model=args.model, prompt_tokens=sizes, shorts=args.sessions,
                       codecs=tuple(c for c in args.codecs.split(",") if c), links=links,
                       stall_ratio=args.stall_ratio, control_s=args.control_s,
                       busy_tokens=max(sizes) if args.busy_control is None
                       else args.busy_control,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    path = write_result("disagg.json", res, args.out)
    print(f"{'prompt':>6s} {'mode':24s} {'long TTFT s':>11s} {'ITL p50/p99 ms':>15s} "
          f"{'p99/p50':>7s} {'KV MB':>7s} {'KV ms':>8s} identical")
    for size in res["sizes"]:
        for m in size["modes"]:
            kv, itl = m["kv"], m["short_itl_s"]
            print(f"{size['prompt_tokens']:>6d} {m['mode']:24s} {m['long_ttft_s']:>11.2f} "
                  f"{itl['p50'] * 1e3:>7.0f}/{itl['p99'] * 1e3:<7.0f} {m['p99_over_p50'] or 0:>7.2f}"
                  f" {kv.get('kv_bytes', 0) / 1e6:>7.1f} {kv.get('kv_ms', 0):>8.0f} "
                  f"{m['long_ids_identical_to_verifier_alone']}")
    for c in (res.get("control"), res.get("busy_control")):
        if c:
            print(f"{'-':>6s} {c['mode']:24s} {'-':>11s} {c['short_itl_s']['p50'] * 1e3:>7.0f}/"
                  f"{c['short_itl_s']['p99'] * 1e3:<7.0f} {c['p99_over_p50'] or 0:>7.2f}")
    for link, why in res["skipped"].items():
        print(f"skipped {link}: {why}")
    png = plot(res, path.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0
