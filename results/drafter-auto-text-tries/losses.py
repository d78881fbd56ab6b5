"""Where `auto`'s time goes in ab_trees_auto.py's runs (issue 44): each block's drafting +
verify ms less what plain decoding's mean step (the same round's plain run) takes for the
tokens it committed, summed by why the block was drafted, per arm, and the time outside
the blocks (the decode time less every block's: the tries read off the text draft there,
with the free candidates' shadows). Positive: time lost. Medians over the rounds.

    python results/drafter-auto-text-tries/losses.py runs.json [PROMPT]
"""
import json
import statistics
import sys
from collections import defaultdict


def main() -> None:
    runs = json.load(open(sys.argv[1]))["runs"]
    only = sys.argv[2] if len(sys.argv) > 2 else None
    for kind, rounds in runs.items():
        if only and kind != only:
            continue
        for arm in ("old", "new"):
            cols = defaultdict(list)
            for r in rounds:
                plain, run = r["plain"], r[arm]
                step = 1e3 / plain["tok_s"]  # ms a token, plain decoding
                tokens = len(run["ids"])
                by = defaultdict(float)
                blocks = 0.0
                for b in run["trace"]:
                    ms = b["draft_ms"] + b["verify_ms"]
                    blocks += ms
                    by[b["why"]] += ms - (1 + b["accepted"]) * step
                decode = tokens / run["tok_s"] * 1e3
                by["outside blocks"] = decode - blocks
                by["total"] = decode - tokens * step
                for k, v in by.items():
                    cols[k].append(v)
            print(f"{kind:<14}{arm:<4}" + "  ".join(
                f"{k} {statistics.median(v):+6.0f}" for k, v in sorted(cols.items())))


if __name__ == "__main__":
    main()
