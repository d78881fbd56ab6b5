"""`macfleet bench serve`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import sys


def add_bench_parsers(bs) -> None:
    s = bs.add_parser("serve", help="streaming clients against `macfleet serve`: tokens/s, TTFT, "
                      "inter-token latency; decode stall under a long prompt (results/serve.json)")
    s.add_argument("--clients", default="1,4,8,16", help="comma-separated client counts")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="per answer (default 32; 96 with --json-schema)")
    s.add_argument("--time-limit", type=float, default=900.0, help="seconds for everything")
    s.add_argument("--no-stall", action="store_true", help="skip the decode-stall measurement")
    s.add_argument("--fleet", action="store_true", help="through a local fleet instead "
                   "(macfleet up + serve): the verifier agent batching vs one session at a "
                   "time (results/serve_fleet.json); with --prediction: the same workloads "
                   "through it (results/serve_prediction_fleet.json)")
    s.add_argument("--stall-only", action="store_true",
                   help="only the decode-stall measurement (results/serve_stall.json)")
    s.add_argument("--mlx-lm", default=None, metavar="DIR",
                   help="also measure mlx_lm.server on this mlx-lm directory (macfleet export; "
                   "default: macfleet only)")
    s.add_argument("--head-to-head", type=int, default=0, metavar="ROUNDS",
                   help="with --mlx-lm: both servers up, ROUNDS alternating rounds of the "
                        "largest --clients count against each; the ratio per round "
                        "(results/serve_h2h.json)")
    s.add_argument("--multi-turn", action="store_true",
                   help="one chat of --turns turns with a growing history through the openai "
                   "package: time to first token per turn with the prompt cache and without "
                   "(results/serve_chat.json)")
    s.add_argument("--turns", type=int, default=8, help="with --multi-turn")
    s.add_argument("--repeats", type=int, default=1,
                   help="with --multi-turn: chats per server, each on a fresh one (the ratio "
                   "is the median of theirs); with --mlx-lm also mlx_lm.server's; with "
                   "--prediction: runs of each request each way, alternating (the speed-up is "
                   "the ratio of the medians)")
    s.add_argument("--json-schema", action="store_true",
                   help="structured output through the openai package: the same questions "
                   "free and bound to a JSON schema, with the n-gram drafter and none; tokens "
                   "per verifier step (forced tokens counted), validity "
                   "(results/serve_json.json)")
    s.add_argument("--questions", type=int, default=6, help="with --json-schema (1-6)")
    s.add_argument("--proposer", default="ngram,none", metavar="SPEC[,SPEC...]",
                   help="with --json-schema: comma-separated proposer specs, one server each "
                   "(e.g. retrieval+ngram,ngram,none: token trees against chains); with "
                   "--prediction: the first is the server's drafter beside the prediction")
    s.add_argument("--prediction", action="store_true",
                   help="OpenAI Predicted Outputs: code-edit and copy workloads on 100-400 "
                   "line files (chat and completions), each request's speed-up with its "
                   "prediction against without, beside the share of the answer the prediction "
                   "held (results/serve_prediction.json)")
    s.add_argument("--lines", type=int, default=None,
                   help="with --prediction: keep the files' first N lines (a short run; "
                   "default: the whole files)")
    s.add_argument("--workloads", default=None,
                   help="with --prediction: comma-separated workloads (default: all of copy, "
                   "edit, edit-guess, useless, complete-copy, complete-edit, regenerate; "
                   "bench/serve_prediction.py says what each asks)")
    s.set_defaults(func=run_serve)
    b = bs.add_parser("batch-identity", help="greedy answers batched vs alone over many "
                      "requests: divergence rate per mode (results/batch_identity.json)")
    b.add_argument("--requests", type=int, default=200, help="requests in all")
    b.add_argument("--max-tokens", type=int, default=24, help="answer length cap, in tokens")
    b.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    b.set_defaults(func=run_identity)
    k = bs.add_parser("serve-soak", help="many requests of misbehaving clients (disconnects, "
                      "timeouts, bad JSON) against one server (results/serve_soak.json)")
    k.add_argument("--requests", type=int, default=1000, help="requests in all")
    k.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    k.add_argument("--time-limit", type=float, default=600.0, help="seconds for everything")
    k.set_defaults(func=run_soak)


def run_serve(args) -> int:
    from macfleet.bench.record import write_result
    from macfleet.bench.serve import bench_serve, plot, summary_rows
    from macfleet.cli.common import UserError

    if args.prediction:
        return _run_prediction(args, lambda m: print(m, file=sys.stderr, flush=True))
    if args.max_tokens is None:
        args.max_tokens = 96 if args.json_schema else 32
    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--clients must be numbers separated by commas, got {args.clients}")
    if not clients or min(clients) < 1 or args.max_tokens < 1:
        raise UserError("--clients and --max-tokens must be >= 1")
    if args.stall_only:
        clients = []
    progress = (lambda m: print(m, file=sys.stderr, flush=True))
    if args.multi_turn:
        return _run_multi_turn(args, progress)
    if args.json_schema:
        return _run_json_schema(args, progress)
    if args.head_to_head:
        return _run_head_to_head(args, max(clients), progress)
    if args.fleet:
        from macfleet.bench.serve import bench_serve_fleet

        res = bench_serve_fleet(args.model, clients, args.max_tokens, args.time_limit, progress)
        name = "serve_fleet"
    else:
        res = bench_serve(args.model, clients, args.max_tokens, args.time_limit, progress,
                          stall=not args.no_stall, mlx_lm_dir=args.mlx_lm)
        name = "serve_stall" if args.stall_only else "serve"
    path = write_result(f"{name}.json", res, args.out)
    if clients and plot(res, args.out / f"{name}.png"):
        print(f"wrote {args.out / f'{name}.png'}")
    for line in summary_rows(res):
        print(line)
    print(f"wrote {path}")
    return 0


def _run_multi_turn(args, progress) -> int:
    from macfleet.bench.record import write_result
    from macfleet.bench.serve_chat import bench_multi_turn, chat_rows
    from macfleet.cli.common import UserError

    if args.turns < 1 or args.repeats < 1:
        raise UserError("--turns and --repeats must be >= 1")
    res = bench_multi_turn(args.model, args.turns, args.max_tokens, progress,
                           repeats=args.repeats, mlx_lm_dir=args.mlx_lm)
    path = write_result("serve_chat.json", res, args.out)
    for line in chat_rows(res):
        print(line)
    print(f"wrote {path}")
    return 0


def _run_prediction(args, progress) -> int:
    import time

    from macfleet.bench.record import write_result
    from macfleet.bench.serve_prediction import WORKLOADS, bench_prediction, prediction_rows
    from macfleet.cli.common import UserError

    workloads = (WORKLOADS if args.workloads is None else
                 tuple(w.strip() for w in args.workloads.split(",") if w.strip()))
    if not workloads or set(workloads) - set(WORKLOADS):
        raise UserError(f"--workloads must name some of {', '.join(WORKLOADS)}")
    if args.lines is not None and args.lines < 1:
        raise UserError("--lines must be >= 1")
    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    max_tokens = args.max_tokens if args.max_tokens is not None else 1024
    res = bench_prediction(args.model, proposer=args.proposer.split(",")[0], lines=args.lines,
                           max_tokens=max_tokens, workloads=workloads,
                           deadline=time.monotonic() + args.time_limit, fleet=args.fleet,
                           repeats=args.repeats, progress=progress)
    name = "serve_prediction_fleet.json" if args.fleet else "serve_prediction.json"
    path = write_result(name, res, args.out)
    for line in prediction_rows(res):
        print(line)
    print(f"wrote {path}")
    return 0


def _run_json_schema(args, progress) -> int:
    from macfleet.bench.record import write_result
    from macfleet.bench.serve_json import PEOPLE, bench_json_schema, json_rows
    from macfleet.cli.common import UserError

    if not 1 <= args.questions <= len(PEOPLE):
        raise UserError(f"--questions must be 1..{len(PEOPLE)}")
    drafters = tuple(d.strip() for d in args.proposer.split(",") if d.strip())
    if not drafters:
        raise UserError("--proposer needs at least one drafter spec")
    res = bench_json_schema(args.model, args.questions, args.max_tokens, progress, drafters)
    path = write_result("serve_json.json", res, args.out)
    for line in json_rows(res):
        print(line)
    print(f"wrote {path}")
    return 0


def _run_head_to_head(args, clients: int, progress) -> int:
    import time

    from macfleet.bench.record import write_result
    from macfleet.bench.serve import head_to_head
    from macfleet.cli.common import UserError

    if args.head_to_head < 1 or not args.mlx_lm or args.fleet or args.stall_only:
        raise UserError("--head-to-head ROUNDS (>= 1) needs --mlx-lm DIR, and neither --fleet "
                        "nor --stall-only")
    res = head_to_head(args.model, args.mlx_lm, clients, args.max_tokens, args.head_to_head,
                       time.monotonic() + args.time_limit, progress)
    path = write_result("serve_h2h.json", res, args.out)
    sm = res["summary"]
    if sm.get("rounds"):
        print(f"{clients} clients, {sm['rounds']} rounds: macfleet / mlx_lm.server median "
              f"{sm['ratio_median']}x (min {sm['ratio_min']}x, max {sm['ratio_max']}x); "
              f"failed {res['failed']}")
    print(f"wrote {path}")
    return 0


def run_identity(args) -> int:
    from macfleet.bench.batch_identity import bench_identity
    from macfleet.bench.record import write_result
    from macfleet.cli.common import UserError
    from macfleet.engine.models import load_model

    if min(args.requests, args.max_tokens, args.concurrency) < 1:
        raise UserError("--requests, --max-tokens and --concurrency must be >= 1")
    res = bench_identity(load_model(args.model), args.requests, args.max_tokens,
                         args.concurrency, lambda m: print(m, file=sys.stderr, flush=True))
    name = "batch_identity.json" if args.model == "smollm2" else (
        f"batch_identity_{args.model.replace(':', '_')}.json")
    path = write_result(name, res, args.out)
    for mode, r in res["modes"].items():
        print(f"{mode:10s} diverged {r['diverged']}/{res['requests']} "
              f"({r['divergence_rate']:.1%}), {r['iterations']} iterations, {r['seconds']} s")
    print(f"wrote {path}")
    return 0


def run_soak(args) -> int:
    from macfleet.bench.record import write_result
    from macfleet.bench.serve_soak import soak

    res = soak(args.model, args.requests, args.concurrency, args.time_limit,
               lambda m: print(m, file=sys.stderr, flush=True))
    path = write_result("serve_soak.json", res, args.out)
    print(f"{res['requests']} requests ({res['by_kind']}): {res['failed']} failed; server "
          f"{'alive' if res['server_alive_at_end'] else 'DEAD'}, "
          f"{res['sessions_left_at_end']} sessions left; RSS {res['rss_before_mib']} -> "
          f"{res['rss_after_mib']} MiB, open files {res['fds_before']} -> {res['fds_after']}")
    print(f"wrote {path}")
    return 0 if res["failed"] == 0 and res["server_alive_at_end"] and res["flat"] else 1
