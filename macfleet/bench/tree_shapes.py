"""`macfleet bench tree-shapes`: the head's EAGLE-2 trees, shape against shape.

A shape is the beam width (`top_k`), the deepest level (`max_depth`) and the draft vocabulary
of the levels below the first (`deep_vocab`: its most frequent ids, 0 = all of it). Two
measures, side by side in one run:

* offline: on the verifier's greedy answers to the unseen prompts (HELD_OUT + UNSEEN), fed
  the verifier's true features, the head drafts every level of its tree at every `step`-th
  answer position; the tree of its N best nodes accepts the longest path whose tokens are the
  verifier's greedy ones (exact under greedy: the answer *is* the verifier's continuation).
  Mean accepted per tree size N, and the median time to draft the whole tree. Deterministic
  in its acceptance, so shapes compare without the loop's timing noise.
* in the loop (`repeats` > 0): the held-out prompts generated with each shape, interleaved
  rounds against plain decoding, as `bench drafter` does; the tree size is then chosen by the
  loop's own cost model from the measured verify(L) and drafting time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from macfleet.bench.store_curve import accepted_in_tree
from macfleet.distill.prompts import HELD_OUT, prompt_kind, prompt_text
from macfleet.engine.models import LoadedModel

NODES = (4, 8, 16, 24, 32)


@dataclass(frozen=True)
class TreeShape:
    top_k: int
    max_depth: int
    deep_vocab: int  # 0: every level drafts from the head's whole draft vocabulary

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """'TOP_K,MAX_DEPTH,DEEP_VOCAB', e.g. '4,5,4096'."""
        try:
            k, d, v = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"a tree shape is TOP_K,MAX_DEPTH,DEEP_VOCAB (e.g. 4,5,4096), "
                             f"not {text!r}") from None
        if k < 1 or d < 1 or v < 0:
            raise ValueError(f"tree shape {text!r}: TOP_K and MAX_DEPTH >= 1, DEEP_VOCAB >= 0")
        return cls(k, d, v)

    @property
    def name(self) -> str:
        return f"top{self.top_k} depth{self.max_depth} deep{self.deep_vocab or 'all'}"


DEFAULT_SHAPES = (TreeShape(4, 5, 4096), TreeShape(4, 5, 0), TreeShape(4, 5, 2048),
                  TreeShape(3, 7, 4096))


def offline(lm: LoadedModel, head, shapes: Sequence[TreeShape], *, max_answer: int = 160,
            step: int = 2, nodes: Sequence[int] = NODES,
            progress: Callable[[str], None] = lambda s: None) -> dict:
    from macfleet.bench.drafter import answer_samples, prompts_json
    from macfleet.distill.prompts import UNSEEN
    from macfleet.engine.proposers.eagle.tree import EagleTreeProposer

    prompts = {**HELD_OUT, **UNSEEN}
    samples = answer_samples(lm, list(prompts.values()), max_answer)
    kinds = [prompt_kind(k) for k, t in prompts.items()
             if prompt_text(t) in {s.prompt.text for s in samples}]
    progress(f"{sum(len(s.tokens) - s.n_prompt for s in samples)} answer tokens from "
             f"{len(samples)} prompts")
    out = {}
    for shape in shapes:
        prop = EagleTreeProposer(head, name=shape.name, top_k=shape.top_k,
                                 max_depth=shape.max_depth, deep_vocab=shape.deep_vocab)
        got: dict[str, dict[int, list[int]]] = {g: {n: [] for n in nodes}
                                                for g in ("chat", "code")}
        ms: list[float] = []
        for s, kind in zip(samples, kinds):
            toks = [int(t) for t in s.tokens]
            prop.start()
            prop.feed_features(0, toks, s.hidden)
            group = got[kind]
            for t in range(s.n_prompt, len(toks) - 1, step):
                t0 = time.perf_counter()
                cand = prop.candidates(toks[:t])
                ms.append((time.perf_counter() - t0) * 1e3)
                for n in nodes:
                    tree, parents = cand.best(n)
                    group[n].append(accepted_in_tree(tree, parents, range(len(tree)),
                                                     toks[t:]))
            prop.close()
        row: dict = {**asdict(shape), "draft_ms_median": round(statistics.median(ms), 2),
                     "starts": len(ms)}
        for g in ("chat", "code", "all"):
            row[g] = {str(n): round(statistics.fmean(
                got["chat"][n] + got["code"][n] if g == "all" else got[g][n]), 4)
                for n in nodes}
        out[shape.name] = row
        progress(f"{shape.name}: full tree {row['draft_ms_median']:.1f} ms; mean accepted "
                 + ", ".join(f"{n} nodes {row['all'][str(n)]:.3f}" for n in nodes))
    return {"prompts": prompts_json(prompts), "max_answer": max_answer, "step": step,
            "nodes": list(nodes),
            "method": "the verifier's greedy answers with their true features; every step-th "
                      "answer position the head drafts all levels of its tree; the tree of "
                      "its N best nodes accepts its longest path of the verifier's greedy "
                      "tokens; draft_ms: the whole tree (root, every level) per block",
            "shapes": out}


def in_loop(lm: LoadedModel, head, shapes: Sequence[TreeShape], *, repeats: int,
            max_tokens: int = 64, progress: Callable[[str], None] = lambda s: None) -> dict:
    from macfleet.bench.drafter import _groups, _rounds, _row
    from macfleet.engine.controller import AUTO
    from macfleet.engine.proposers.eagle.tree import EagleTreeProposer
    from macfleet.engine.events import Finished
    from macfleet.engine.proposers.group import make_group
    from macfleet.engine.text import encode_prompt
    from macfleet.serve.one import decode_ids

    by_name = {s.name: s for s in shapes}
    specs = ("none", *by_name)

    def run(kind: str, name: str, ref):
        shape = by_name.get(name)
        drafting = None if shape is None else make_group(
            [EagleTreeProposer(head, name=name, top_k=shape.top_k, max_depth=shape.max_depth,
                               deep_vocab=shape.deep_vocab)], AUTO)
        ids = encode_prompt(lm.tokenizer, HELD_OUT[kind], True)
        fin = None
        for ev in decode_ids(lm, ids, drafting, max_tokens=max_tokens):
            if isinstance(ev, Finished):
                fin = ev
        assert fin is not None
        row = _row(fin.stats, fin.token_ids, ref)
        progress(f"in the loop {kind:8s} {name:26s} {row['decode_tokens_per_s']:.1f} tok/s, "
                 f"tau {fin.stats.accepted / max(fin.stats.blocks, 1):.2f}")
        return row, fin.token_ids

    runs = _rounds(repeats, tuple(HELD_OUT), specs, run)
    return {"runs": runs, "summary": _groups(runs, specs), "repeats": repeats,
            "max_tokens": max_tokens}

