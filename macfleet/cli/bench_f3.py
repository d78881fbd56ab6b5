"""`macfleet bench f3`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import sys


def add_bench_parsers(bs) -> None:
    f = bs.add_parser("f3", help="F3 hidden-state wire cost per payload size and link "
                      "(results/f3_overhead.json + .png)")
    f.add_argument("--repeats", type=int, default=10, help="timed sends per payload size")
    f.add_argument("--max-mib", type=int, default=16, help="largest payload (MiB, power of 4)")
    f.add_argument("--no-netns", action="store_true", help="loopback only")
    f.add_argument("--encryption", action="store_true", help="instead: open vs closed (CURVE) "
                   "fleet per payload size and SmolLM2 flow -> results/security.json")
    f.set_defaults(func=run_f3)
    s = bs.add_parser("security", help="closed-fleet cost (open vs CURVE) and a fuzz campaign "
                      "against live agents (results/security.json)")
    s.add_argument("--repeats", type=int, default=10, help="timed sends per payload size")
    s.add_argument("--max-mib", type=int, default=16, help="largest payload (MiB, power of 4)")
    s.add_argument("--messages", type=int, default=3000, help="fuzz messages in all")
    s.add_argument("--skip-encryption", action="store_true",
                   help="skip the open vs closed fleet cost")
    s.add_argument("--skip-fuzz", action="store_true", help="skip the fuzz campaign")
    s.add_argument("--only", choices=("encryption", "fuzz", "faults", "flood", "closed",
                                      "third"),
                   default=None,
                   help="re-run one part; the file's other figures are kept (faults: the "
                   "fault cases incl. the ring cut in the netns test bed; flood: idle "
                   "connections from one address; closed: five attacks on a fresh local "
                   "fleet -- SSRF, session slots, session ownership, keyless churn, a rogue "
                   "client key; third: replayed Zeroconf cards, a grammar past the grammar "
                   "engine's limits, a flood of huge message arrays, two API keys' prompt "
                   "caches; default: every part)")
    s.add_argument("--case", action="append", default=None, metavar="CASE",
                   help="with --only third: only these cases (replayed_cards, "
                   "grammar_past_limits, message_flood, cache_per_key); the others' figures "
                   "are kept (default: every case)")
    s.set_defaults(func=run_security)


def _read_security(out) -> dict:
    import json

    try:
        return json.loads((out / "security.json").read_text())
    except (OSError, ValueError):
        return {}


def _update_security(out, section: dict, parts: tuple[str, ...] = ()):
    """results/security.json keeps the other sections when one is re-run; `parts` names the
    parts re-run (default: the sections) for the record of commands."""
    from macfleet.bench.record import write_result

    old = _read_security(out)
    keep = {k: v for k, v in old.items()
            if k in ("encryption", "fuzz", "closed_fleet", "third_pass") and k not in section}
    commands = {**old.get("commands", {}), **{k: " ".join(["macfleet", *sys.argv[1:]])
                                                for k in parts or section}}
    return write_result("security.json", {**keep, **section, "commands": commands}, out)


def _run_part(args, part: str) -> int:
    """--only faults / flood: re-measure that part of the fuzz section on fresh agents and
    merge it into the file's fuzz section."""
    from macfleet.bench.fuzz import one_part

    res = one_part(part, progress=_progress)
    fuzz = dict(_read_security(args.out).get("fuzz", {}))
    if part == "faults":
        fuzz["faults"] = res
        for case, f in res.items():
            _print_fault(case, f)
    else:
        fuzz["idle_flood"] = res
        if "totals" in fuzz:  # the flood's crash/hang count in the totals
            doors = fuzz.get("doors", {}).values()
            fuzz["totals"] = {**fuzz["totals"],
                              "crashes": sum(d["crashes"] for d in doors) + res["crash"],
                              "hangs": sum(d["hangs"] for d in doors) + res["hang"]}
        print(f"{res['summary']} (cap {res['cap_per_address']} per address while past their "
              f"handshake's time, budget {res.get('pending_budget')}); a key holder from "
              f"{res['ping_from']} answered in {res['ping_ms_during']} ms; "
              f"{res['shed_after_handshake_deadline']} closed after the handshake deadline")
    path = _update_security(args.out, {"fuzz": fuzz}, (f"fuzz.{part}",))
    print(f"wrote {path}")
    return 0


def _run_closed(args) -> int:
    from macfleet.bench.closed_fleet import closed_fleet

    res = closed_fleet(progress=_progress)
    for case, r in res.items():
        if isinstance(r, dict):
            pings = (f"  pings {100 * r['ping_success']:.0f}% ok, median {r['ping_ms_median']} "
                     f"ms, max {r['ping_ms_max']} ms" if "ping_success" in r else "")
            rest = {k: v for k, v in r.items() if not k.startswith("ping")}
            print(f"{case}: {rest}{pings}")
    path = _update_security(args.out, {"closed_fleet": res}, ("closed_fleet",))
    print(f"wrote {path}")
    return 0


def _run_third(args) -> int:
    from macfleet.bench.third_pass import PARTS, third_pass

    cases = tuple(getattr(args, "case", None) or PARTS)
    unknown = sorted(set(cases) - set(PARTS))
    if unknown:
        from macfleet.cli.common import UserError

        raise UserError(f"--case {', '.join(unknown)}: one of {', '.join(PARTS)}")
    res = third_pass(progress=_progress, parts=cases)
    old = _read_security(args.out).get("third_pass", {})
    merged = {**old, **res} if set(cases) != set(PARTS) else res
    for case in cases:
        print(f"{case}: {res[case]}")
    path = _update_security(args.out, {"third_pass": merged},
                            tuple(f"third_pass.{c}" for c in cases))
    print(f"wrote {path}")
    return 0


def _print_fault(case: str, f: dict) -> None:
    if "skipped" in f:
        print(f"fault {case}: skipped ({f['skipped']})")
    else:
        print(f"fault {case}: {f.get('outcome', '')[:80]} after {f.get('seconds_after_fault')} s"
              f", {f.get('tokens_received')} tokens received")


def run_security(args, *, fuzz: bool | None = None, encryption: bool | None = None) -> int:
    only = getattr(args, "only", None)
    if only in ("faults", "flood"):
        return _run_part(args, only)
    if only == "closed":
        return _run_closed(args)
    if only == "third":
        return _run_third(args)
    if only == "encryption":
        fuzz = False
    elif only == "fuzz":
        encryption = False
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
        print(res["idle_flood"]["summary"])
        for case, f in res["faults"].items():
            _print_fault(case, f)
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
