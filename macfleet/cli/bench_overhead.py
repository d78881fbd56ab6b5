"""`macfleet bench overhead`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

import argparse
import sys


def add_bench_parsers(bs) -> None:
    o = bs.add_parser(
        "overhead", help="how much of the device's speed the loop keeps: plain macfleet vs "
        "mlx-lm, an oracle drafter vs the ideal from verify(L), the default drafter, random "
        "big llamas (results/overhead-<device>.json)")
    o.add_argument("--model", default=argparse.SUPPRESS, help="the verifier (default smollm2)")
    o.add_argument("--dtype", default="native",
                   help="comma-separated, each measured in turn: native (as loaded), float32, "
                   "bfloat16, float16, 4bit (nn.quantize), q (the model's own quantized format)")
    o.add_argument("--max-tokens", type=int, default=64, help="answer tokens per run")
    o.add_argument("--repeats", type=int, default=2,
                   help="timed interleaved rounds after one warm-up round (fastest kept)")
    o.add_argument("--prompts", type=int, default=6, metavar="N",
                   help="the first N held-out prompts of bench drafter")
    o.add_argument("--ks", default="1,3,7,15", help="the oracle's block lengths (drafts)")
    o.add_argument("--proposer", default="auto", help="part (c)'s drafter (default: auto)")
    o.add_argument("--big-shape", default=None,
                   help="random-weight llamas of part (d): mini, 1b, 3b, 8b (comma-separated; "
                   "default: 1b on a GPU, none on a CPU, where building a 1b takes minutes "
                   "and its forward seconds)")
    o.add_argument("--big-dtype", default=None,
                   help="their dtype(s): float32, bfloat16, float16, 4bit (default: bfloat16 "
                   "on a GPU, float32 on a CPU)")
    o.add_argument("--big-max-tokens", type=int, default=None,
                   help="answer tokens of part (d) (default: --max-tokens on a GPU, 16 on a "
                   "CPU)")
    o.add_argument("--big-prompts", type=int, default=2, help="random prompts of part (d)")
    o.add_argument("--big-ks", default=None, help="part (d)'s block lengths (default: --ks on "
                   "a GPU, 3,7 on a CPU)")
    o.add_argument("--max-runs", type=int, default=4,
                   help="oracle runs per prompt and k while block decoding departs")
    o.add_argument("--skip", default="",
                   help="parts to skip, among a,b,c,d (comma-separated; default: none)")
    o.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="no model or timed round starts after S seconds (at least one timed "
                   "round per model that starts); what ran is written (default: no limit)")
    o.add_argument("--device-name", default=None,
                   help="the file's tag (default: cpu, or the accelerator's short name)")
    o.set_defaults(func=run)


def _gpu_name() -> str:
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return ""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run(args) -> int:
    from macfleet.bench import overhead as ov
    from macfleet.bench import weights as w
    from macfleet.cli.common import UserError

    try:
        dtypes = w.parse_dtypes(args.dtype)
        ks = ov.parse_ks(args.ks)
        skip = ov.parse_skip(args.skip)
    except ValueError as e:
        raise UserError(str(e)) from None
    if min(args.max_tokens, args.repeats, args.prompts, args.max_runs, args.big_prompts) < 1:
        raise UserError("--max-tokens, --repeats, --prompts, --max-runs and --big-prompts "
                        "must be >= 1")
    import mlx.core as mx

    from macfleet import sysinfo
    from macfleet.bench.overhead_run import BIG_CURVE_LENGTHS, measure_model, random_prompts
    from macfleet.bench.record import write_result
    from macfleet.engine.proposers.choice import resolve_proposer
    from macfleet.distill.prompts import HELD_OUT
    from macfleet.engine.models import ModelSpecError
    from macfleet.engine.text import encode_prompt

    import time

    gpu = mx.default_device() != mx.cpu
    deadline = time.monotonic() + args.time_limit if args.time_limit else None

    def over() -> bool:
        return deadline is not None and time.monotonic() > deadline
    try:
        big_dtypes = w.parse_dtypes(args.big_dtype or ("bfloat16" if gpu else "float32"))
        big_ks = ov.parse_ks(args.big_ks) if args.big_ks else (ks if gpu else (3, 7))
        shapes = () if "d" in skip else w.parse_shapes(
            args.big_shape if args.big_shape is not None else ("1b" if gpu else "none"))
    except ValueError as e:
        raise UserError(str(e)) from None
    big_tokens = args.big_max_tokens or (args.max_tokens if gpu else 16)
    tag = args.device_name or ov.device_tag(str(mx.default_device()), _gpu_name(),
                                            sysinfo.chip())

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    spec, why = resolve_proposer(args.proposer, args.model)
    texts = dict(list(HELD_OUT.items())[: args.prompts])
    doc: dict = {"device": tag, "model": args.model, "tokens": args.max_tokens,
                 "rounds": args.repeats, "ks": list(ks), "skipped": sorted(skip),
                 "default_drafter": {"asked": args.proposer, "spec": spec, "why": why},
                 "sections": []}
    for dtype in dtypes if {"a", "b", "c"} - skip else ():
        if over():
            doc.setdefault("not_measured", []).append(f"{args.model} {dtype}: time limit")
            continue
        try:
            bm = w.project_model(args.model, dtype)
        except ModelSpecError as e:
            raise UserError(str(e)) from None
        ids = {p: encode_prompt(bm.lm.tokenizer, t, chat=True) for p, t in texts.items()}
        doc["sections"].append(measure_model(
            bm, ids, tokens=args.max_tokens, rounds=args.repeats, ks=ks, mlx="a" not in skip,
            oracle="b" not in skip, texts=None if "c" in skip else texts,
            default_spec=None if "c" in skip or spec == "none" else spec,
            max_runs=args.max_runs, deadline=deadline, progress=say))
        _done(doc["sections"][-1], ov)
        del bm
    for shape in shapes:
        for dtype in big_dtypes:
            if over():
                doc.setdefault("not_measured", []).append(f"random {shape} {dtype}: time limit")
                continue
            say(f"building a random llama {shape} in {dtype} ...")
            bm = w.random_llama(shape, dtype)
            doc["sections"].append(measure_model(
                bm, random_prompts(int(bm.model.args.vocab_size), args.big_prompts),
                tokens=big_tokens, rounds=args.repeats, ks=big_ks, max_runs=args.max_runs,
                curve_lengths=BIG_CURVE_LENGTHS, deadline=deadline, progress=say))
            _done(doc["sections"][-1], ov)
            del bm
            mx.clear_cache()
    path = write_result(f"overhead-{tag}.json", doc, args.out)
    png = args.out / f"overhead-{tag}.png"
    if doc["sections"] and ov.plot(doc, png):
        print(f"wrote {png}")
    print(f"wrote {path}")
    return 0


def _done(section: dict, ov) -> None:
    for line in ov.headline(section):
        print(line, flush=True)
