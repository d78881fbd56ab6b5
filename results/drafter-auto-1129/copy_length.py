"""What a chosen free chain drafter (n-gram lookup) commits per verify under a length rule,
on real answers (issue 44, engine/choosing.py free_chain_k): deterministic, no clock.

The answer is plain greedy decoding's (smollm2, 96 tokens); n-gram lookup is a pure function
of the context, so at every answer position how many of its k drafts a greedy verifier
accepts is fixed (k = 4, 8, 16). A session where n-gram drafts every block then costs
verify(1 + drafted) per block, read off the day's traced verify(L) shape (replay.py `shape`),
in plain steps; the figure is tokens committed per plain step (> 1: faster than plain).

  python results/drafter-auto-1129/copy_length.py [--cache /tmp/positions.json] [PROMPT...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # reference_loops (issue 49)
KS = (4, 8, 16)


def positions(kinds) -> dict:
    from macfleet.bench.drafter import BENCH_PROMPTS
    from macfleet.engine.chooser import tree_match
    from macfleet.engine.events import Finished
    from macfleet.engine.models import load_model
    from macfleet.engine.proposers.factory import make_proposer
    from macfleet.engine.text import encode_prompt
    from reference_loops import generate_local

    lm = load_model("smollm2")
    out = {}
    for kind in kinds:
        fin = None
        for ev in generate_local(lm, BENCH_PROMPTS[kind], proposer="none", max_tokens=96):
            if isinstance(ev, Finished):
                fin = ev
        ans = list(fin.token_ids)
        ids = list(encode_prompt(lm.tokenizer, BENCH_PROMPTS[kind], True))
        p = make_proposer("ngram", lm)
        out[kind] = {str(k): [(tree_match(d.tokens, d.parents, ans[i:]), len(d))
                              for i in range(len(ans))
                              for d in [p.propose(ids + ans[:i], k)]] for k in KS}
    return out


def session(drafts: dict, cost, rule: str) -> float:
    n = len(drafts["4"])
    at, steps, k = 0, 0.0, 4
    while at < n:
        kk = int(rule[1:]) if rule.startswith("k") else k
        acc, drafted = drafts[str(kk)][at]
        acc = min(acc, n - at)
        steps += cost(1 + drafted)
        if rule == "double":  # free_chain_k's rule
            from macfleet.engine.choosing import free_chain_k
            k = free_chain_k(kk, drafted, acc)
        at += 1 + acc
    return n / steps


def main() -> int:
    from macfleet.engine.tree_budget import VerifyCurve
    from replay import shape

    ap = argparse.ArgumentParser()
    ap.add_argument("prompts", nargs="*", default=["paragraph", "explain", "chat", "code",
                                                   "describe", "chat:romeo", "problem",
                                                   "followup"])
    ap.add_argument("--cache", type=Path, default=None)
    args = ap.parse_args()
    if args.cache and args.cache.is_file():
        pos = json.loads(args.cache.read_text())
    else:
        pos = positions(args.prompts)
        if args.cache:
            args.cache.write_text(json.dumps(pos))
    for day in ("fast", "slow"):
        curve = VerifyCurve()
        curve.seed(shape(json.loads((HERE / f"{day}.json").read_text())))
        print(f"## {day} day's verify(L) shape: n-gram drafting every block, tokens per plain step")
        print(f"{'prompt':12s}" + "".join(f"{r:>9s}" for r in ("k4", "k8", "k16", "double")))
        for kind, drafts in pos.items():
            print(f"{kind:12s}" + "".join(f"{session(drafts, curve.cost, r):9.3f}"
                                          for r in ("k4", "k8", "k16", "double")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
