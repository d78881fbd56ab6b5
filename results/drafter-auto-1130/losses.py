"""Where `auto` loses time against plain decoding, block by block, in a `bench drafter` record
(issue 44): each block's cost (its drafting + verify ms) less what plain decoding's own steps
(the plain run's mean verify ms a block, same prompt) would have taken for the tokens it
committed (1 + accepted), summed by why the block was drafted (prior / explore / best) and
by drafter. Positive: time lost. Pure arithmetic over the median run's trace.

    python results/drafter-auto-1130/losses.py drafter.json [PROMPT,...]
"""
import json
import sys
from collections import defaultdict


def main() -> None:
    d = json.load(open(sys.argv[1]))
    runs = d["in_process"]["runs"]
    want = sys.argv[2].split(",") if len(sys.argv) > 2 else list(runs)
    for p in want:
        plain, auto = runs[p]["none"], runs[p]["auto"]
        step = plain["verify_ms"] / plain["blocks"]
        by_why, by_drafter = defaultdict(float), defaultdict(float)
        total = 0.0
        for b in auto["trace"]:
            cost = b["draft_ms"] + b["verify_ms"]
            lost = cost - (1 + b["accepted"]) * step
            by_why[b["why"]] += lost
            by_drafter[b["drafter"]] += lost
            total += cost
        ratio = auto["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        print(f"{p}: auto {ratio:.3f}x plain; plain step {step:.0f} ms; auto's blocks "
              f"{total / 1e3:.2f} s; lost (ms, + = slower than plain steps): "
              + ", ".join(f"{k} {v:+.0f}" for k, v in sorted(by_why.items()))
              + " | " + ", ".join(f"{k} {v:+.0f}" for k, v in
                                  sorted(by_drafter.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
