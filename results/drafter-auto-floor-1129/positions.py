"""What each free drafter of `auto` (n-gram lookup, the answer store, both) accepts at every
position of the real greedy answers (issue 44): deterministic, no clock.

Both are pure functions of the context (the answer store's tree sizing left at its start), so
at every answer position what a greedy verifier accepts of their drafts is fixed: n-gram at
k = 4, 8, 16 (choosing.py: SHADOW_K, then free_chain_k doubling), the answer store at the
tree budget, both as one tree. text_replay.py replays the chooser on these.

  python results/drafter-auto-floor-1129/positions.py --out positions.json [PROMPT...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KS = (4, 8, 16)


def positions(kinds, max_tokens: int = 96) -> dict:
    from macfleet.bench.drafter import BENCH_PROMPTS
    from macfleet.engine.chooser import tree_depth, tree_match
    from macfleet.engine.events import Finished
    from macfleet.engine.models import load_model
    from macfleet.engine.proposers.factory import make_proposer
    from macfleet.engine.text import encode_prompt, generate_local
    from macfleet.engine.tree_loop import TREE_DRAFTER_BUDGET

    lm = load_model("smollm2")
    out = {}
    for kind in kinds:
        fin = None
        for ev in generate_local(lm, BENCH_PROMPTS[kind], proposer="none",
                                 max_tokens=max_tokens):
            if isinstance(ev, Finished):
                fin = ev
        ans = list(fin.token_ids)
        ids = list(encode_prompt(lm.tokenizer, BENCH_PROMPTS[kind], True))
        ng, ret = make_proposer("ngram", lm), make_proposer("retrieval", lm)
        row = {f"ngram{k}": [] for k in KS}
        row["retrieval"] = []
        for i in range(len(ans)):
            ctx, rest = ids + ans[:i], ans[i:]
            for k in KS:
                d = ng.propose(ctx, k)
                row[f"ngram{k}"].append((tree_match(d.tokens, d.parents, rest), len(d)))
            d = ret.propose(ctx, TREE_DRAFTER_BUDGET)
            row["retrieval"].append((tree_match(d.tokens, d.parents, rest), len(d),
                                     tree_depth(d.parents, len(d))))
        out[kind] = row
        print(kind, len(ans), file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts", nargs="*")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from macfleet.bench.drafter import BENCH_PROMPTS

    args.out.write_text(json.dumps(positions(args.prompts or list(BENCH_PROMPTS))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
