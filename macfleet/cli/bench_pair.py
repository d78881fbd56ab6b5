"""`macfleet bench pair`: a big verifier beside a real draft model, on one Mac and on two
(bench/pair.py says what each figure means); registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_bench_parsers(bs) -> None:
    p = bs.add_parser(
        "pair", help="a wide SmolLM2 verifier with the real SmolLM2 as its draft model: plain "
        "and drafting in series against mlx-lm on one core, then a draft-model agent drafting "
        "ahead on a second core (results/pair.json, pair.png)")
    p.add_argument("--widths", default="5120,auto",
                   help="verifier MLP widths: 5120 (with the dial's 2 extra layers: c ≈ 0.4 by "
                   "bytes), auto (the c ≈ 0.15 width of results/pair_dial.json)")
    p.add_argument("--acceptance", default="0.95,0.8,0.6",
                   help="target per-token acceptances, each set by the dial of "
                   "results/pair_dial.json (`macfleet bench pair-dial` writes it)")
    p.add_argument("--settings", default=None,
                   help="WIDTH:TARGET pairs to run (comma-separated), instead of every width "
                   "with every acceptance (default: every pair)")
    p.add_argument("--prompts", type=int, default=6, metavar="N",
                   help="the first N of bench/pair.py's PAIR_PROMPTS (at most 8)")
    p.add_argument("--max-tokens", type=int, default=96, help="answer tokens per run")
    p.add_argument("--draft-tokens", type=int, default=4,
                   help="draft tokens per block of the one-process runs (mlx-lm and macfleet)")
    p.add_argument("--batch-sessions", type=int, default=None, metavar="N",
                   help="the verifier agent's continuous batch (0: one session at a time; "
                   "default: the agent's)")
    p.add_argument("--sessions", type=int, default=1, metavar="N",
                   help="also N requests at once through the two agents (the verifier's "
                   "batch, the draft agent's streams drafted together), two rounds drafted "
                   "ahead and two by the verifier agent alone (default: 1, one at a time only)")
    p.add_argument("--stall-ratio", type=float, default=None, metavar="R",
                   help="the verifier agent's --stall-ratio (default: its own)")
    p.add_argument("--dial", type=Path, default=None,
                   help="the dial record (default: OUT/pair_dial.json)")
    p.add_argument("--dial-kind", choices=("layers", "draft"), default="layers",
                   help="what sets the acceptance: layers (the verifier's extra layers, eps; "
                   "below ~0.8 its answers degenerate into repetition), draft (the draft's "
                   "weight noise beside an eps-0 verifier that writes SmolLM2's own answers; "
                   "`bench pair-dial --parts draft` calibrates it)")
    p.add_argument("--skip", default="", help="parts to skip: one (the one-process runs), "
                   "plain (the one-process plain runs, mlx-lm's and macfleet's: two agents are "
                   "then compared with the verifier agent alone only), two (the agents), "
                   "contention (the draft model's token alone and beside the verifier "
                   "verifying on the other core) (default: none)")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def dial_settings(doc: dict, kind: str) -> dict[float, dict]:
    """target -> the dial entry bench pair runs: the verifier's eps and extra layers, the
    draft's noise (the layer dial: noise 0; the draft dial: eps 0, so the extra layers are
    identities and cost what they cost at every setting of a width)."""
    layers = doc["dial"]
    base = {"extra_layers": layers["extra_layers"], "seed": layers["seed"], "kind": kind}
    if kind == "layers":
        return {float(s["target"]): {**s, **base, "draft_noise": 0.0}
                for s in layers["settings"]}
    if "draft_dial" not in doc:
        raise SystemExit("--dial-kind draft: the dial record has no draft dial (`macfleet "
                         "bench pair-dial --parts draft`)")
    return {float(s["target"]): {**s, **base, "eps": 0.0, "draft_noise": s["noise"],
                                 "seed": doc["draft_dial"]["seed"]}
            for s in doc["draft_dial"]["settings"]}


def _settings(args) -> list[tuple[int, float, dict]]:
    """(width, target acceptance, dial entry) to run, from results/pair_dial.json."""
    path = args.dial or args.out / "pair_dial.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `macfleet bench pair-dial` first")
    doc = json.loads(path.read_text())
    dial = dial_settings(doc, args.dial_kind)
    auto = [w["width"] for w in doc.get("cost", {}).get("widths", []) if w.get("auto")]
    widths = [int(w) if w != "auto" else (auto[-1] if auto else None)
              for w in args.widths.split(",")]
    if None in widths:
        raise SystemExit("--widths auto: results/pair_dial.json has no auto width "
                         "(`macfleet bench pair-dial --parts cost`)")
    if args.settings:
        pairs = [(int(w), float(a)) for w, a in (x.split(":") for x in args.settings.split(","))]
    else:
        pairs = [(w, a) for w in widths for a in (float(x) for x in args.acceptance.split(","))]
    out = []
    for w, a in pairs:
        if a not in dial:
            raise SystemExit(f"acceptance {a} has no dial setting in {path}: targets "
                             f"{sorted(dial)}")
        out.append((w, a, dial[a]))
    return out


def run(args) -> int:
    from macfleet.bench.pair import PAIR_PROMPTS, summarize, with_alone, with_plain
    from macfleet.bench.pair_model import build_pair_draft, build_pair_verifier
    from macfleet.bench.pair_run import run_contention, run_pinned, two_agents
    from macfleet.bench.record import write_result

    if args.sessions < 1:
        raise SystemExit(f"--sessions {args.sessions}: at least 1 (one request at a time)")
    prompts = PAIR_PROMPTS[: max(1, min(args.prompts, len(PAIR_PROMPTS)))]
    skip = set(args.skip.split(",")) - {""}
    rows = []
    plain_of: dict[int, dict] = {}  # width -> its plain runs by prompt (shapes, not weights)
    alone_of: dict[int, dict] = {}  # width -> its verifier-agent-alone runs by prompt (same)
    beside: dict[int, dict] = {}  # width -> the draft token alone and beside the verifier
    for width, target, dial in _settings(args):
        _log(f"width {width}, acceptance ~{target}: building the verifier")
        vdir = str(build_pair_verifier(width, dial["extra_layers"], dial["eps"], dial["seed"]))
        draft = build_pair_draft(dial["draft_noise"], dial["seed"])
        one = None if "one" in skip else run_pinned(vdir, prompts, args.max_tokens,
                                                    args.draft_tokens,
                                                    plain=width not in plain_of
                                                    and "plain" not in skip, draft_spec=draft)
        if one is not None and "plain" not in skip:
            if width not in plain_of:
                plain_of[width] = {r["prompt"]: {n: r[n] for n in ("plain", "mlx_plain")}
                                   for r in one["runs"]}
            one = with_plain(one, plain_of[width])
        _log(f"width {width}, acceptance ~{target}: one process done")
        two = None if "two" in skip else two_agents(vdir, prompts, args.max_tokens, _log,
                                                    batch_sessions=args.batch_sessions,
                                                    alone=width not in alone_of,
                                                    draft_spec=draft, sessions=args.sessions,
                                                    stall_ratio=args.stall_ratio)
        if two is not None:
            if width not in alone_of:
                alone_of[width] = {r["prompt"]: r["agent_alone"] for r in two["runs"]}
            two = with_alone(two, alone_of[width])
        if two is not None and "contention" not in skip and width not in beside:
            beside[width] = run_contention(vdir)
        rows.append(summarize(width=width, target=target, dial=dial, k=args.draft_tokens,
                              one=one, two=two))
        if width in beside:  # where the two agents share one memory bus (this box)
            rows[-1]["draft_ms_contention"] = beside[width]
        rows[-1].update(command=command_line(), tokens=args.max_tokens, prompts=len(prompts))
        path = write_result("pair.json", {"prompts": list(prompts), "tokens": args.max_tokens,
                                          "k": args.draft_tokens,
                                          "settings": kept(args.out / "pair.json", rows) + rows},
                            args.out)
        _print_row(rows[-1])
    _plot(json.loads(path.read_text())["settings"], args.out / "pair.png")
    print(f"wrote {path}")
    return 0


def command_line() -> str:
    import shlex

    return "macfleet " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def kept(path: Path, rows: list[dict]) -> list[dict]:
    """The settings an earlier run wrote to `path` that this one does not measure again (each
    row keeps the command that made it), so settings can be measured in several runs."""
    if not path.is_file():
        return []
    new = {setting_key(r) for r in rows}
    doc = json.loads(path.read_text())
    return [{**r, "command": r.get("command") or doc.get("command")}
            for r in doc.get("settings", []) if setting_key(r) not in new]


def setting_key(row: dict) -> tuple:
    """A row's setting: width, target acceptance and which dial set it (rows written before
    the draft dial were the layer dial's)."""
    return row["width"], row["target"], row.get("dial_kind", "layers")


def _print_row(r: dict) -> None:
    f = r["figures"]
    dial = (f"draft noise {r['draft_noise']:.3g}" if r.get("dial_kind") == "draft"
            else f"eps {r.get('eps') or 0:.3g}")
    print(f"width {r['width']} {_measured(r)} (target {r['target']}, {dial}) | ids "
          f"{'identical' if r['identical'] else 'DIFFER'}")
    for name, v in f.items():
        ceil = v.get("ceiling")
        print(f"  {name:34s} {v['geomean']:5.2f}x (min {v['min']:.2f})"
              + (f"  ceiling {ceil:.2f}x" if ceil else ""))
    if r.get("pair_agents"):
        a = r["pair_agents"]
        print(f"  draft agent: lead {a['lead']:.1f} drafts, waste {a['waste']:.0%}, "
              f"verifier waits {a['wait_ms']:.0f} ms a block")
        if a.get("block_ms"):  # one block's time on both agents
            loop = a["block_ms"] - a["verify_ms_per_block"] - a["wait_ms"]
            print(f"  a block: {a['block_ms']:.0f} ms = verify {a['verify_ms_per_block']:.0f} + "
                  f"wait {a['wait_ms']:.0f} + loop {loop:.0f}"
                  f"; {a['mean_accepted'] + 1:.2f} tokens; the agent drafts a token in "
                  f"{a.get('agent_token_ms', 0):.0f} ms (alone: {r.get('draft_ms', 0):.0f})")
    if r.get("draft_ms_contention"):
        c = r["draft_ms_contention"]
        print(f"  one draft token: {c['alone']:.0f} ms alone, {c['beside_verifier']:.0f} ms "
              "while the verifier verifies on the other core (one memory bus)")


def _measured(r: dict) -> str:
    """c and the acceptance where the one-process runs measured them (`--skip one`: not)."""
    return f"c={r['c']:.2f} acceptance {r['alpha']:.2f}" if "c" in r else "c, acceptance not run"


def _plot(rows: list[dict], out: Path) -> Path | None:
    from macfleet.bench.record import pyplot

    plt = pyplot()
    if plt is None or not rows:
        return None
    # plain decoding: in one process where it was run (else the verifier agent alone)
    names = [("one process / plain", ("in-process draft model / plain",
                                      "in-process draft model / verifier agent alone")),
             ("mlx-lm speculative / mlx-lm plain", ("mlx-lm speculative / mlx-lm plain",)),
             ("two agents / plain", ("two agents / plain", "two agents / verifier agent alone"))]
    at_once = sorted({k for r in rows for k in r["figures"] if "sessions at once" in k})
    names += [(k.replace(" / verifier agent alone", " / alone"), (k,)) for k in at_once]
    names = [(label, keys) for label, keys in names  # a part skipped in every row: no bar
             if any(k in r["figures"] for r in rows for k in keys)]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / len(names)
    for i, (label, keys) in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))]
        got = [next((r["figures"][k] for k in keys if k in r["figures"]), {}) for r in rows]
        ys = [g.get("geomean", 0.0) for g in got]
        ax.bar(xs, ys, width, label=label)
        ceil = [g.get("ceiling") for g in got]
        ax.scatter([x for x, c in zip(xs, ceil) if c], [c for c in ceil if c], marker="_",
                   s=300, color="black", zorder=3)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([(f"c={r['c']:.2f}\nacc {r['alpha']:.2f}" if "c" in r else
                         f"width {r['width']}\ntarget {r['target']}")
                        + ("\n(draft dial)" if r.get("dial_kind") == "draft" else "")
                        for r in rows])
    ax.set_ylabel("speed-up over plain decoding (geomean)")
    ax.set_title("bench pair: a draft model in series vs drafting ahead on a second core\n"
                 "(bars: measured; ticks: ceilings)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
