"""`macfleet bench drafter`: drafters on held-out prompts, one process and two agents
(results/drafter.json, results/drafter_curve.png)."""

from __future__ import annotations

from pathlib import Path


def add_bench_parsers(bs) -> None:
    d = bs.add_parser("drafter", help="every drafter on held-out chat and code prompts")
    d.add_argument("--max-tokens", type=int, default=64, help="answer length cap, in tokens")
    d.add_argument("--proposer", default=None, metavar="SPEC[,SPEC...]",
                   help="drafters to compare in one process, comma-separated (none first: the "
                   "baseline; default: every drafter, macfleet/bench/drafter.py DEFAULT_SPECS)")
    d.add_argument("--no-agents", action="store_true", help="skip the 2-agent fleet part")
    d.add_argument("--no-head-eval", action="store_true",
                   help="skip the shipped head's acceptance on the held-out answers (it "
                   "generates every held-out answer once more)")
    d.add_argument("--prompts", default=None, metavar="KIND[,KIND...]",
                   help="these prompts in one process: keys of macfleet/distill/prompts.py "
                   "HELD_OUT or UNSEEN, or the sets held, unseen, all (default: held)")
    d.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every drafter on every prompt N times, in interleaved rounds, "
                   "and keep each one's median run (this box drifts ~10%% between runs; "
                   "an odd N: of an even count the slower middle run is kept, so with 2 one "
                   "stalled run decides)")
    d.add_argument("--curve", default=None, metavar="CURVE.jsonl",
                   help="a distill run's held-out curve to plot (results/drafter_curve.png; "
                        "default: the curve recorded in the head's eval file)")
    d.add_argument("--dataset", type=Path, default=None, metavar="DIR|ARCHIVE",
                   help="the head's training dataset (a directory or a tar archive of one), "
                   "for the contamination figures: its prompts near the held-out ones, and "
                   "its answers' 8-grams in theirs (default: "
                   "results/distill-smollm2-7.6M.tar.xz when present)")
    d.add_argument("--no-contamination", action="store_true",
                   help="skip the held-out prompts' contamination figures")
    d.add_argument("--record", action="store_true",
                   help="record the measured best drafters as this machine's default (auto), "
                   "in its cache")
    d.add_argument("--record-shipped", action="store_true",
                   help="also record them in the shipped head's eval file: the default of "
                   "machines without their own record (the project's reference run)")
    d.set_defaults(func=run)
    h = bs.add_parser("heads", help="draft heads side by side on unseen prompts' answers "
                      "(chain acceptance, first draft's top-k; results/drafter_heads.json)")
    h.add_argument("heads", nargs="*", type=Path, metavar="HEAD",
                   help="head paths (default: the model's shipped head)")
    h.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    h.set_defaults(func=run_heads)
    c = bs.add_parser("data-curve", help="retrieval drafts against the size of the verifier's "
                      "answer store, on the dataset's held-out prompt groups (no model runs)")
    c.add_argument("--dataset", type=Path, default=Path("results/distill-smollm2"),
                   help="a `macfleet distill --tokens N` dataset (default: %(default)s)")
    c.add_argument("--max-starts", type=int, default=2000,
                   help="held-out answer positions scored per store size")
    c.add_argument("--goal", type=float, default=2.5, help="tau to extrapolate the data to")
    c.set_defaults(func=run_data_curve)
    t = bs.add_parser("tree-shapes", help="the head's EAGLE-2 tree shapes side by side: "
                      "acceptance per tree size on unseen prompts' answers, drafting time, "
                      "and speed in the loop (results/tree_shapes.json)")
    t.add_argument("shapes", nargs="*", metavar="TOP_K,MAX_DEPTH,DEEP_VOCAB",
                   help="beam width, deepest level, draft ids of the levels below the first "
                   "(0: all; default: 4,5,4096 4,5,0 4,5,2048 3,7,4096)")
    t.add_argument("--head", type=Path, default=None, help="the draft head (default: the "
                   "shipped head)")
    t.add_argument("--max-tokens", type=int, default=160, help="tokens per answer (offline)")
    t.add_argument("--step", type=int, default=2, help="draft at every N-th answer position")
    t.add_argument("--repeats", type=int, default=0, metavar="N",
                   help="also generate the held-out prompts with every shape, N "
                   "interleaved rounds against plain decoding (0: offline only)")
    t.add_argument("--loop-tokens", type=int, default=64, metavar="N",
                   help="tokens per held-out answer in the loop (with --repeats; default: "
                   "%(default)s)")
    t.set_defaults(func=run_tree_shapes)


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from macfleet.bench import drafter as b
    from macfleet.bench.record import write_result
    from macfleet.cli.common import UserError
    from macfleet.engine.proposers.shipped import default_head_path
    from macfleet.engine.models import ModelSpecError, load_model

    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    try:
        lm = load_model(args.model)
    except ModelSpecError as e:
        raise UserError(str(e)) from None
    specs = (tuple(s.strip() for s in args.proposer.split(",") if s.strip()) if args.proposer
             else b.DEFAULT_SPECS)
    if specs[0] != "none":
        specs = ("none", *specs)

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    from macfleet.distill.prompts import HELD_OUT_CHANGES

    try:
        kinds = b.prompt_kinds(args.prompts)
    except ValueError as e:
        raise UserError(str(e)) from None

    answers: dict[str, list[int]] = {}
    doc: dict = {"model": lm.spec, "max_tokens": args.max_tokens, "greedy": True,
                 "held_out_prompts": b.prompts_json({k: b.BENCH_PROMPTS[k] for k in kinds}),
                 # which prompts changed since the previous recorded set, and why
                 "held_out_changes": HELD_OUT_CHANGES,
                 "in_process": b.bench_in_process(lm, specs, args.max_tokens, say,
                                                  args.repeats, answers, kinds)}
    if not args.no_contamination:
        from macfleet.bench.contamination import DEFAULT_DATASET, contamination

        if args.dataset is not None and not args.dataset.exists():
            raise UserError(f"--dataset {args.dataset}: no such directory or archive")
        try:
            doc["contamination"] = contamination(lm, answers, args.dataset or DEFAULT_DATASET,
                                                 say)
        except ValueError as e:
            raise UserError(str(e)) from None
    # the best FIXED drafter (what a record names); `auto` is measured beside it
    best, speedup = b.best_spec(doc["in_process"]["summary"], b.fixed_specs(specs))
    doc["best_in_process"] = {"spec": best, "speedup_geomean": speedup}
    vs = b.auto_vs_best_fixed(doc["in_process"]["runs"], doc["in_process"]["summary"], specs)
    if vs is not None:
        doc["auto_vs_best_fixed"] = vs
        doc["machine_drift"] = b.machine_drift(doc["in_process"]["runs"])
    if not args.no_agents:
        agent_specs = b.agent_specs(specs, best)
        doc["agents"] = b.bench_agents(lm, agent_specs, args.max_tokens, say, args.repeats)
        best_a, speedup_a = b.best_spec(doc["agents"]["summary"], b.fixed_specs(agent_specs))
        doc["best_agents"] = {"spec": best_a, "speedup_geomean": speedup_a}
        vs_a = b.auto_vs_best_fixed(doc["agents"]["runs"], doc["agents"]["summary"],
                                    agent_specs)
        if vs_a is not None:
            doc["agents"]["auto_vs_best_fixed"] = vs_a
    agents = doc.get("best_agents") or {}
    record = b.bench_record(best, speedup, "macfleet " + " ".join(sys.argv[1:]),
                            agents.get("spec"), agents.get("speedup_geomean"),
                            b.drafter_figures(doc["in_process"]["runs"], specs))
    if args.record or args.record_shipped:
        from macfleet.engine.proposers.choice import record_machine_choice

        say(f"this machine's default drafter: {best} in one process"
            + (f", {agents['spec']} across agents" if agents else "")
            + f" ({record_machine_choice(lm.spec, record)})")
    head = default_head_path(lm.spec)
    if head is not None and head.is_file():
        from macfleet.engine.proposers.eagle.head import read_eval

        doc["head"] = read_eval(head)
        if not args.no_head_eval:
            doc["head_on_held_out_prompts"] = b.head_on_held_out(lm)
        if args.record_shipped:
            b.record_best(head, record)
    elif args.record_shipped:
        say(f"no head is shipped for {lm.spec}: only this machine's record was written")
    # the distill run's learning curve: a curve.jsonl given here, else the one recorded in
    # the head's eval file (every warm-started run of it, training tokens added up)
    from macfleet.distill.pipeline import cumulative_curve

    curve = ([json.loads(line) for line in Path(args.curve).read_text().splitlines() if line]
             if args.curve else cumulative_curve(doc.get("head")))
    if curve:
        doc["training_curve"] = curve
        x = curve[-1]["train_tokens"] if curve else 1
        summ = doc["in_process"]["summary"]
        final = {f"{s}, {g} prompts: tau in the loop (bench)": (x, summ[g][s]["tau"])
                 for g in ("chat", "code") if g in summ
                 for s in ("eagle", "eagle2") if s in summ[g]}
        doc["training_curve_fit"] = fit = b.curve_fit(curve)
        if fit and fit["train_tokens_for_goal"]:
            say(f"training curve: {fit['b_per_doubling']:+.3f} held-out acceptance per "
                f"doubling of training tokens; {fit['goal']} at ~"
                f"{fit['train_tokens_for_goal']:.2g} tokens (now {fit['train_tokens_now']:.2g})")
        args.out.mkdir(parents=True, exist_ok=True)  # --out may name a new directory
        png = b.plot_curve(curve, args.out / "drafter_curve.png", final, fit)
        say(f"wrote {png}" if png else "drafter_curve.png not written: matplotlib is missing "
            "(pip install 'macfleet[bench]')")
    path = write_result("drafter.json", doc, args.out)
    for where in ("in_process", "agents"):
        if where not in doc:
            continue
        for group in ("chat", "code"):
            for s, r in doc[where]["summary"].get(group, {}).items():
                print(f"{where:10s} {group:4s} {s:14s} tau {r['tau']:.2f}  speedup "
                      f"{r['speedup']:.2f}x (geomean {r['speedup_geomean']:.2f}x, min "
                      f"{r['speedup_min']:.2f}x)  identical {r['all_identical']}")
    for where, v in (("", vs), (" across agents", doc.get("agents", {}).get(
            "auto_vs_best_fixed"))):
        if v is not None:
            print(f"auto{where}: {b.auto_verdict(v)}")
    print(f"best in one process: {best} ({speedup:.2f}x); wrote {path}")
    return 0


def run_heads(args) -> int:
    import sys

    from macfleet.bench import drafter as b
    from macfleet.bench.record import write_result
    from macfleet.cli.common import UserError
    from macfleet.engine.proposers.eagle.head import HeadMismatch, weights_path
    from macfleet.engine.proposers.shipped import default_head_path
    from macfleet.engine.models import ModelSpecError, load_model

    try:
        lm = load_model(args.model)
    except ModelSpecError as e:
        raise UserError(str(e)) from None
    paths = list(args.heads) or [p for p in [default_head_path(lm.spec)] if p is not None]
    if not paths:
        raise UserError(f"no draft head for {lm.spec}: name one (`macfleet distill` trains one)")
    for p in paths:
        if not weights_path(p).is_file():
            raise UserError(f"no draft head at {weights_path(p)}")
    if args.max_tokens < 8:
        raise UserError("--max-tokens must be >= 8")
    try:
        doc = b.compare_heads(lm, paths, args.max_tokens,
                              progress=lambda s: print(s, file=sys.stderr, flush=True))
    except HeadMismatch as e:
        raise UserError(str(e)) from None
    path = write_result("drafter_heads.json", doc, args.out)
    for name, r in doc["heads"].items():
        print(f"{name}: k=4 chain mean accepted chat {r['chat']['mean_accepted']:.3f} code "
              f"{r['code']['mean_accepted']:.3f} all {r['all']['mean_accepted']:.3f}; first "
              f"draft top-1 {r['first_draft_topk']['1']:.3f} top-8 "
              f"{r['first_draft_topk']['8']:.3f}")
    print(f"wrote {path}")
    return 0


def run_data_curve(args) -> int:
    import sys

    from macfleet.bench import store_curve
    from macfleet.bench.record import write_result
    from macfleet.cli.common import UserError
    from macfleet.distill.dataset import DatasetError

    if not (args.dataset / "manifest.json").is_file():
        raise UserError(f"{args.dataset}: not a distillation dataset (no manifest.json); make "
                        f"one with `macfleet distill --model M --tokens N --dataset DIR`")
    try:
        doc = store_curve.data_curve(args.dataset, max_starts=args.max_starts, goal=args.goal,
                                     progress=lambda s: print(s, file=sys.stderr, flush=True))
    except (DatasetError, ValueError, OSError) as e:
        raise UserError(str(e)) from None
    path = write_result("data_curve.json", doc, args.out)
    png = store_curve.plot(doc, args.out / "data_curve.png")
    for n, t in doc["store_tokens_for_goal"].items():
        f = doc["fit"][n]
        print(f"tree of {n:>2s} nodes: +{f['b_per_doubling']:.3f} tau per doubling of the store; "
              f"tau {args.goal} at ~{t:.2g} answer tokens" if f and t else
              f"tree of {n:>2s} nodes: tau does not grow with the store here")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


def run_tree_shapes(args) -> int:
    import sys

    from macfleet.bench import tree_shapes as ts
    from macfleet.bench.record import write_result
    from macfleet.cli.common import UserError
    from macfleet.engine.proposers.eagle.head import HeadMismatch, weights_path
    from macfleet.engine.proposers.eagle.load import shared_head
    from macfleet.engine.proposers.shipped import default_head_path
    from macfleet.engine.models import ModelSpecError, load_model

    try:
        shapes = [ts.TreeShape.parse(s) for s in args.shapes] or list(ts.DEFAULT_SHAPES)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.step < 1 or args.repeats < 0 or args.max_tokens < 8 or args.loop_tokens < 1:
        raise UserError("--step >= 1, --repeats >= 0, --max-tokens >= 8 and --loop-tokens >= 1")
    try:
        lm = load_model(args.model)
    except ModelSpecError as e:
        raise UserError(str(e)) from None
    path = args.head or default_head_path(lm.spec)
    if path is None or not weights_path(path).is_file():
        raise UserError(f"no draft head for {lm.spec}: name one with --head (`macfleet "
                        f"distill` trains one)")
    try:
        head = shared_head(weights_path(path), lm.model)
    except HeadMismatch as e:
        raise UserError(str(e)) from None

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    doc: dict = {"model": lm.spec, "head": str(path),
                 "head_draft_vocab": {"size": head.config.draft_vocab,
                                      "order": head.config.draft_order},
                 "offline": ts.offline(lm, head, shapes, max_answer=args.max_tokens,
                                       step=args.step, progress=say)}
    if args.repeats:
        doc["in_loop"] = ts.in_loop(lm, head, shapes, repeats=args.repeats,
                                   max_tokens=args.loop_tokens, progress=say)
    out = write_result("tree_shapes.json", doc, args.out)
    for name, r in doc["offline"]["shapes"].items():
        line = (f"{name:26s} full tree {r['draft_ms_median']:5.1f} ms; accepted with 16 nodes "
                f"chat {r['chat']['16']:.3f} code {r['code']['16']:.3f}")
        if "in_loop" in doc:
            s = doc["in_loop"]["summary"]["all"][name]
            line += (f"; in the loop tau {s['tau']:.2f}, {s['speedup_geomean']:.2f}x geomean "
                     f"(min {s['speedup_min']:.2f}x), draft {s['draft_ms_per_block']:.1f} "
                     f"ms/block")
        print(line)
    print(f"wrote {out}")
    return 0
