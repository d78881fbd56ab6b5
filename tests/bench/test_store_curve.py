"""The data curve of retrieval drafts: exact acceptance along a trie, and the replay on a real
(tiny) distillation dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest

from macfleet.bench.store_curve import (CurvePoint, accepted_in_tree, data_curve, fit_log2,
                                        read_answers, score, tokens_for)
from macfleet.distill.dataset import generate_dataset
from macfleet.engine.proposers.eagle.head import verifier_fingerprint
from macfleet.engine.models import load_model
from macfleet.engine.proposers.retrieval import Datastore


def test_accepted_in_tree_follows_the_longest_kept_path():
    #   root -> 7 -> 8 -> 9      root -> 7 -> 3      root -> 4
    tokens, parents = [7, 4, 8, 3, 9], [-1, -1, 0, 0, 2]
    assert accepted_in_tree(tokens, parents, [0, 1, 2, 3, 4], [7, 8, 9, 1]) == 3
    assert accepted_in_tree(tokens, parents, [0, 1, 2, 3, 4], [7, 3, 9]) == 2
    assert accepted_in_tree(tokens, parents, [0, 1, 2, 3, 4], [4, 8]) == 1
    assert accepted_in_tree(tokens, parents, [0, 1, 2, 3, 4], [5]) == 0
    # a pruned parent cuts its subtree off, however well the child matches
    assert accepted_in_tree(tokens, parents, [0, 1, 4], [7, 8, 9]) == 1
    assert accepted_in_tree(tokens, parents, [0, 2], [7, 8, 9]) == 2


def test_score_counts_what_a_store_of_the_same_answers_would_have_accepted():
    ans = np.array([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], dtype=np.int64)

    class A:
        prompt = np.array([1, 2], dtype=np.int64)
        answer = ans

    hit = score(Datastore.build([ans]), [A()], (1, 4))
    miss = score(Datastore.build([np.arange(100, 140)]), [A()], (1, 4))
    # positions 1..8; at 1 the context's last two tokens (2, 10) are in no answer: a miss
    assert hit.starts == 8 and hit.hit_rate == pytest.approx(7 / 8)
    assert hit.tau[1] == pytest.approx(7 / 8) and hit.tau[4] > 1.5
    assert miss.hit_rate == 0.0 and miss.tau[4] == 0.0


def test_fit_and_extrapolation():
    pts = [CurvePoint(2 ** k, 10, {4: 0.1 * k}, 0.5) for k in (10, 11, 12)]
    a, b = fit_log2(pts, 4)
    assert b == pytest.approx(0.1) and a == pytest.approx(0.0, abs=1e-9)
    assert tokens_for(2.5, (a, b)) == pytest.approx(2 ** 25)
    assert tokens_for(2.5, (1.0, 0.0)) is None and fit_log2(pts[:1], 4) is None


@pytest.mark.slow  # generates a dataset
def test_data_curve_on_a_generated_dataset(tmp_path):
    lm = load_model("tiny:3:32")
    lm.tokenizer.eos_token_ids = {5}
    generate_dataset(lm, tmp_path, 600, fingerprint=verifier_fingerprint(lm.model), batch=8,
                     max_answer=24)
    answers = read_answers(tmp_path)
    assert answers and all(len(a.answer) >= 1 for a in answers)
    doc = data_curve(tmp_path, fractions=(0.5, 1.0), nodes=(1, 4), held_share=0.25,
                     max_starts=200)
    pts = doc["points"]
    assert [p["store_tokens"] for p in pts] == sorted(p["store_tokens"] for p in pts)
    assert pts[-1]["store_tokens"] > pts[0]["store_tokens"] > 0
    assert doc["held_out_answers"] > 0 and doc["train_answers"] > 0
    for p in pts:  # a bigger tree never accepts less at the same positions
        assert p["tau"][4] >= p["tau"][1] >= 0.0
    json.dumps(doc)
