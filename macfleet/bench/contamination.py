"""How held out the held-out prompts are, for `bench drafter`'s results (issue 35), and every
prompt set a bench calls held out or unseen, for `bench unseen` (issue 45).

Per held-out prompt: the nearest training prompt (difflib ratio, distill/contamination)
among every templated prompt and, when the head's dataset is at hand, its questions, subtopics
and the user turns of its shards; and the share of the prompt's greedy answer 8-grams found in
the answer store (the retrieval drafter's) and in the head's training answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from macfleet.distill import contamination as C
from macfleet.distill import contamination_sources as S
from macfleet.distill.prompts import HELD_OUT, HELD_OUT_CHANGES
from macfleet.engine.models import LoadedModel

# the dataset the shipped head was trained on (its eval file says so); read when present
DEFAULT_DATASET = Path("results/distill-smollm2-7.6M.tar.xz")


def nearest_per_prompt(index: C.PromptIndex, held_out: Mapping[str, Sequence[str]],
                       threshold: float = C.NEAR_COPY) -> dict[str, dict]:
    """kind -> the nearest training prompt to any text a user typed in it (every turn of a
    conversation and the whole of it), and its near-copies (pure but for the index)."""
    out = {}
    for kind, texts in held_out.items():
        found = [index.nearest(t, threshold) for t in texts]
        best = max(found, key=lambda n: n.best.ratio if n.best else 0.0)
        near = {m.text: m for n in found for m in n.near_copies}
        merged = C.Nearest(best.query, best.best,
                           tuple(sorted(near.values(), key=lambda m: -m.ratio)), threshold)
        out[kind] = {**merged.to_dict(), "checked_texts": len(texts)}
    return out


def shares_per_prompt(answers: Mapping[str, Sequence[int]], tokens: np.ndarray
                      ) -> dict[str, dict]:
    """kind -> the share of its answer's 8-grams found in `tokens` (a corpus of answers)."""
    kinds = list(answers)
    return {k: s.to_dict() for k, s in zip(kinds, C.ngram_shares([answers[k] for k in kinds],
                                                                 tokens))}


def store_tokens(lm: LoadedModel) -> tuple[Path | None, np.ndarray | None]:
    from macfleet.engine.proposers.retrieval import default_store_path

    path = default_store_path(lm.spec)
    if path is None or not path.with_suffix(".npy").is_file():
        return path, None
    return path, np.load(path.with_suffix(".npy"))


def contamination(lm: LoadedModel, answers: Mapping[str, Sequence[int]],
                  dataset: Path | None = DEFAULT_DATASET,
                  progress: Callable[[str], None] = lambda s: None) -> dict:
    """The figures of every held-out prompt, with what they were checked against.
    answers: kind -> the verifier's greedy answer tokens (the bench's plain-decoding run)."""
    prompts = list(S.template_prompts())
    doc: dict = {"threshold": C.NEAR_COPY, "ngram": C.NGRAM,
                 "method": "nearest training prompt by difflib ratio (lowercased, whitespace "
                           "collapsed, no autojunk) over every text a user typed in the "
                           "prompt, among the candidates of most shared character trigrams; "
                           "answer 8-grams: distinct 8-grams of the prompt's greedy answer "
                           "(this run's plain decoding) found anywhere in the corpus, and the "
                           "most found in any single answer of it"}
    ds_answers = None
    if dataset is not None and dataset.exists():
        progress(f"contamination: reading {dataset}")
        with S.open_dataset(dataset) as root:
            same = S.dataset_verifier(root) == lm.spec
            prompts += list(S.dataset_prompts(root, lm.tokenizer if same else None))
            if same:
                ds_answers = C.corpus(S.dataset_answers(root))
        doc["dataset"] = str(dataset)
        if not same:
            doc["dataset_note"] = (f"{dataset} holds another verifier's tokens: its questions "
                                   f"and subtopics are checked, not its shards or answers")
    else:
        doc["dataset"] = None
        doc["dataset_note"] = (f"{dataset} not found: training prompts are the template "
                               f"families only, and the head's training answers are not "
                               f"checked")
    progress(f"contamination: indexing {len(prompts)} training prompts")
    index = C.PromptIndex(prompts)
    doc["training_prompts"] = index.source_counts()
    near = nearest_per_prompt(index, S.held_out_texts())
    store_path, store = store_tokens(lm)
    doc["answer_store"] = str(store_path) if store is not None else None
    in_store = shares_per_prompt(answers, store) if store is not None else {}
    in_data = shares_per_prompt(answers, ds_answers) if ds_answers is not None else {}
    doc["prompts"] = {k: {**near[k], "answer_in_store": in_store.get(k),
                          "answer_in_training_data": in_data.get(k),
                          "changed": HELD_OUT_CHANGES.get(k)}
                      for k in HELD_OUT if k in near}
    for k, r in doc["prompts"].items():
        progress(f"contamination: {k:9s} nearest {r['nearest_ratio']:.2f} "
                 f"({r['near_copies']} above {C.NEAR_COPY}); answer 8-grams in the store "
                 + (f"{r['answer_in_store']['share']:.0%}" if r["answer_in_store"] else "-")
                 + ", in the training answers "
                 + (f"{r['answer_in_training_data']['share']:.0%}"
                    if r["answer_in_training_data"] else "-"))
    return doc


def greedy_answers(lm: LoadedModel, prompts: Mapping[str, object], max_tokens: int = 64,
                   progress: Callable[[str], None] = lambda s: None) -> dict[str, list[int]]:
    """key -> the verifier's greedy answer (plain decoding) to that request."""
    from macfleet.engine.events import Finished
    from macfleet.serve.one import generate_one

    out = {}
    for k, p in prompts.items():
        for ev in generate_one(lm, p, proposer="none", max_tokens=max_tokens):
            if isinstance(ev, Finished):
                out[k] = list(ev.token_ids)
        progress(f"answer {k}: {len(out.get(k, ()))} tokens")
    return out


def unseen_sets(lm: LoadedModel, dataset: Path | None = DEFAULT_DATASET, max_tokens: int = 64,
                progress: Callable[[str], None] = lambda s: None) -> dict:
    """Every prompt of every set a bench calls held out or unseen (prompts.UNSEEN_SETS): its
    nearest training prompt (templates, and the dataset's questions when at hand) and the
    share of its greedy answer's 8-grams in the answer store and the dataset's answers."""
    from macfleet.distill.prompts import UNSEEN_CHANGES, UNSEEN_SETS

    prompts = list(S.template_prompts())
    ds_answers = None
    if dataset is not None and dataset.exists():
        progress(f"reading {dataset}")
        with S.open_dataset(dataset) as root:
            same = S.dataset_verifier(root) == lm.spec
            prompts += list(S.dataset_prompts(root, lm.tokenizer if same else None))
            if same:
                ds_answers = C.corpus(S.dataset_answers(root))
    progress(f"indexing {len(prompts)} training prompts")
    index = C.PromptIndex(prompts)
    texts = S.unseen_texts()
    near = nearest_per_prompt(index, texts)
    requests = {f"{name}/{k}": p for name, ps in UNSEEN_SETS.items() for k, p in ps.items()}
    answers = greedy_answers(lm, requests, max_tokens, progress)
    _, store = store_tokens(lm)
    in_store = shares_per_prompt(answers, store) if store is not None else {}
    in_data = shares_per_prompt(answers, ds_answers) if ds_answers is not None else {}
    return {"threshold": C.NEAR_COPY, "ngram": C.NGRAM, "max_tokens": max_tokens,
            "dataset": str(dataset) if dataset is not None and dataset.exists() else None,
            "training_prompts": index.source_counts(), "changes": UNSEEN_CHANGES,
            "prompts": {k: {**near[k], "answer_in_store": in_store.get(k),
                            "answer_in_training_data": in_data.get(k)} for k in texts}}
