"""`macfleet bench unseen`: registered into `macfleet bench` by cmd_bench."""

from __future__ import annotations

from pathlib import Path


def add_bench_parsers(bs) -> None:
    u = bs.add_parser("unseen", help="every prompt a bench calls held out or unseen against the "
                      "training prompts and answers (results/unseen_prompts.json)")
    u.add_argument("--dataset", type=Path, default=None, help="the head's dataset (directory "
                   "or archive; default: the shipped head's, when at hand)")
    u.add_argument("--max-tokens", type=int, default=64, help="greedy answer length")
    u.set_defaults(func=run_unseen)


def run_unseen(args) -> int:
    from macfleet.bench.contamination import DEFAULT_DATASET, unseen_sets
    from macfleet.bench.record import write_result
    from macfleet.cli.common import bench_runs, load_model
    from macfleet.distill.contamination import NEAR_COPY

    lm = load_model(args.model)
    with bench_runs("unseen") as say:
        res = unseen_sets(lm, args.dataset or DEFAULT_DATASET, args.max_tokens, say)
    path = write_result("unseen_prompts.json", res, args.out)
    bad = 0
    for k, r in res["prompts"].items():
        st, da = r["answer_in_store"], r["answer_in_training_data"]
        bad += r["near_copies"] > 0
        print(f"{k:24s} nearest {r['nearest_ratio']:.2f} ({r['near_copies']} above "
              f"{NEAR_COPY})  answer 8-grams in the store "
              + (f"{st['share']:.0%} (one answer {st['best_answer_share']:.0%})" if st else "-")
              + ", in the training answers " + (f"{da['share']:.0%}" if da else "-"))
    print(f"{bad} prompt(s) with a near-copy; wrote {path}")
    return 1 if bad else 0
