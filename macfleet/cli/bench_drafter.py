"""`macfleet bench drafter`: trained head vs layer-skip vs n-gram (results/drafter.json)."""

from __future__ import annotations


def add_bench_parsers(bs) -> None:
    d = bs.add_parser("drafter", help="the hidden-state drafter vs other proposers")
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(func=run)


def run(args) -> int:
    from macfleet.engine.drafter.bench import main

    return main(["--model", args.model, "--max-tokens", str(args.max_tokens),
                 "--out", str(args.out / "drafter.json")])
