"""`bench unseen` (macfleet/bench/contamination.py `unseen_sets`): every prompt of every set a
bench calls held out or unseen gets its nearest training prompt and its answer's shares."""

from __future__ import annotations

import pytest

from macfleet.distill import contamination_sources as S
from macfleet.distill.prompts import UNSEEN_CHANGES, UNSEEN_SETS
from macfleet.engine.models import load_model


@pytest.mark.slow  # indexes every templated training prompt
def test_bench_unseen_reports_every_prompt_of_every_set(tmp_path):
    from macfleet.bench.contamination import unseen_sets

    doc = unseen_sets(load_model("tiny:1"), dataset=tmp_path / "none", max_tokens=10)
    want = {f"{name}/{k}" for name, ps in UNSEEN_SETS.items() for k in ps}
    assert set(doc["prompts"]) == want == set(S.unseen_texts())
    assert doc["dataset"] is None and doc["changes"] == UNSEEN_CHANGES
    for k, r in doc["prompts"].items():
        assert 0 < r["nearest_ratio"] <= doc["threshold"] and r["near_copies"] == 0, k
        assert r["answer_in_store"] is None  # a tiny model ships no answer store
