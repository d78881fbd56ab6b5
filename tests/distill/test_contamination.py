"""Held out means held out (issues 35, 45): no training prompt is a near-copy of a prompt any
benchmark calls held out or unseen, the check's figures are the ones they claim to be, and
distillation never adds a near-copy."""

from __future__ import annotations

import itertools
import json
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np
import pytest

from macfleet.engine.conversation import Turn
from macfleet.distill import contamination as C
from macfleet.distill import contamination_sources as S
from macfleet.distill.prompts import (HELD_OUT, HELD_OUT_CHANGES, HELD_OUT_KEYS, UNSEEN,
                                      UNSEEN_CHANGES, UNSEEN_SETS, Prompt, iter_prompts,
                                      prompt_text, user_texts)

ROOT = Path(__file__).resolve().parents[2]  # the repository
ARCHIVE = ROOT / "results" / "distill-smollm2-7.6M.tar.xz"  # the shipped head's dataset
OLD_REWRITE = ("Rewrite this sentence to sound more formal: hey, can u send me the report by "
               "tomorrow? thanks!")


@pytest.fixture(scope="module")
def training() -> C.PromptIndex:
    """Every templated prompt (every chat family's whole space, every topic, code and problem
    phrasing) and the committed dataset's questions: what the benchmark must not near-copy."""
    qs = [(q, "questions") for q in S.archive_questions(ARCHIVE)] if ARCHIVE.is_file() else []
    return C.PromptIndex(itertools.chain(S.template_prompts(), qs))


@pytest.mark.slow  # the near-copy index over >100,000 templated prompts (the `training` fixture)
def test_no_held_out_or_unseen_prompt_has_a_near_copy_among_the_training_prompts(training):
    counts = training.source_counts()
    assert counts["chat:rewrite"] > 100_000 and counts["topics"] > 20_000 and counts["code"]
    if ARCHIVE.is_file():
        assert counts["questions"] > 15_000
    checked = S.unseen_texts()
    assert len(checked) == sum(len(p) for p in UNSEEN_SETS.values()) >= len(HELD_OUT) + 10
    for kind, texts in checked.items():
        for text in texts:
            n = training.nearest(text, max_near=3)
            assert not n.near_copies, (kind, n.to_dict())
            assert n.best is not None and n.best.ratio <= C.NEAR_COPY
    # ... and the check sees what the issue found: the old rewrite prompt near-copies its family
    old = training.nearest(OLD_REWRITE, max_near=3)
    assert len(old.near_copies) == 3 and old.best.source == "chat:rewrite"
    assert "rewrite" in HELD_OUT_CHANGES and HELD_OUT["rewrite"] != OLD_REWRITE


def test_every_set_a_bench_calls_held_out_or_unseen_is_checked():
    """A bench module that names a prompt set held out or unseen reads it from UNSEEN_SETS."""
    import re

    paths = [*(ROOT / "macfleet" / "bench").glob("*.py"),
             *(ROOT / "macfleet" / "cli").glob("bench*.py")]
    assert len(paths) > 20
    for path in paths:
        src = path.read_text()
        for name in set(re.findall(r"\b(HELD_OUT|UNSEEN)\b", src)):
            assert name in UNSEEN_SETS, (path.name, name)
    assert UNSEEN_SETS["UNSEEN"] is UNSEEN and UNSEEN_SETS["HELD_OUT"] is HELD_OUT


@pytest.mark.slow  # the near-copy index (the `training` fixture)
@pytest.mark.skipif(not ARCHIVE.is_file(), reason="the shipped head's dataset is not here")
def test_the_unseen_prompts_the_issue_found_seen_were_replaced(training):
    """Issue 45: five unseen prompts had training near-copies (one verbatim); the check sees
    them, and none is in the set any more."""
    old = {"chat:tea": "How do I make a good cup of tea?",
           "code:tuple": "What is the difference between a list and a tuple in Python?",
           "code:js-max": "Write a JavaScript function that returns the largest number in an "
                          "array."}
    for key, text in old.items():
        assert training.nearest(text, max_near=1).near_copies, key
        assert key not in UNSEEN and text not in UNSEEN.values() and key in UNSEEN_CHANGES
    assert set(UNSEEN_CHANGES).isdisjoint(UNSEEN)


def test_the_set_holds_a_multi_turn_follow_up_and_a_pasted_paragraph():
    conv = HELD_OUT["followup"]
    assert not isinstance(conv, str) and [t.role for t in conv] == ["user", "assistant", "user"]
    assert set(user_texts(conv)) == {conv[0].content, conv[2].content, prompt_text(conv)}
    assert "\n\n" in HELD_OUT["paragraph"] and HELD_OUT["paragraph"].count("?") >= 1
    assert Prompt.of("held", conv).key in HELD_OUT_KEYS
    assert {"followup", "paragraph"} <= set(HELD_OUT_CHANGES)


def test_nearest_is_difflibs_best_ratio_and_counts_every_near_copy():
    base = [f"Explain how {x} works." for x in ("a kettle", "a toaster", "a clock", "a dam")]
    texts = base + ["Describe a quiet beach at night.", "Write a poem about the sea."]
    index = C.PromptIndex((t, "t") for t in texts + ["  EXPLAIN how a kettle works. "])
    assert len(index) == len(texts)  # normalised, each once
    for q in ("Explain how a kettel works!", "Describe a beach at night", "unrelated words"):
        n = index.nearest(q, threshold=0.75)
        ratios = [SequenceMatcher(None, C.normalise(t), C.normalise(q), autojunk=False).ratio()
                  for t in texts]
        assert n.best.ratio == pytest.approx(max(ratios))
        assert C.similarity(q, n.best.text) == pytest.approx(max(ratios))
        assert len(n.near_copies) == sum(r > 0.75 for r in ratios)
    # the bound never undercuts the ratio
    b = index.bounds(C.normalise("Explain how a kettel works!"))
    assert all(b[i] >= C.similarity("Explain how a kettel works!", t) - 1e-9
               for i, t in enumerate(index.texts))


def test_ngram_shares_count_distinct_answer_8grams_in_the_corpus_and_its_richest_answer():
    answer = list(range(100, 120))  # 13 distinct 8-grams
    corpus = C.corpus([list(range(100, 110)),  # 3 of them
                       [7, 7, *range(105, 116), 9],  # 4 (105..112 .. 108..115)
                       [100, 101, 102, 103, 999, 5, 6, 7]])  # shares a 4-token prefix only
    (s,) = C.ngram_shares([answer], corpus)
    assert (s.total, s.found, s.best) == (13, 7, 4)
    assert s.to_dict()["share"] == round(7 / 13, 4)
    # a gram spanning two answers of the corpus is not in it
    (t,) = C.ngram_shares([[1, 2, 3, 4, 5, 6, 7, 8]], C.corpus([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert (t.total, t.found) == (1, 0)


@pytest.mark.slow
def test_distill_drops_near_copies_of_held_out_prompts():
    near = [Prompt("self", "Describe a busy market on a Saturday morning!", "self:a"),
            Prompt("self", "Rewrite this recipe step so a beginner can follow it: cream the "
                           "butter and the sugar, fold in flour, then bake for 15 minutes.",
                   "self:b"),
            Prompt("self", "How often should I feed it if I keep it on the kitchen table?",
                   "self:c")]
    fine = [Prompt("self", f"How do I look after plant number {i}?", "self:p") for i in range(5)]
    got = [p for _, p in zip(range(200), iter_prompts(seed=1, extra=near + fine))]
    assert {p.text for p in got if p.source == "self"} == {p.text for p in fine}
    held = S.held_out_texts()
    assert all(max(C.similarity(h, p.text) for hs in held.values() for h in hs) <= C.NEAR_COPY
               for p in got)


def test_self_instruct_never_keeps_a_near_copy_of_a_held_out_request():
    from macfleet.distill.self_instruct import parse_list

    got = parse_list("1. Explain how a refrigerator keeps the food cold?\n"
                     "2. What should I pack for a weekend hiking trip in the mountains?\n"
                     "3. How do I repot a cactus without hurting my hands?\n")
    assert got == ["How do I repot a cactus without hurting my hands?"]


def test_distill_adds_no_near_copy_to_a_dataset(tmp_path):
    from macfleet.distill.dataset import done_keys, generate_dataset
    from macfleet.engine.proposers.eagle.head import verifier_fingerprint
    from macfleet.engine.models import load_model

    lm = load_model("tiny:3:32")
    copies = ["What should I pack for a weekend camping trip in the mountains, please?",
              "A shop sells pencils at 3 for $1. How much do 28 pencils cost? Explain."]
    ok = ["How do I keep basil alive on a windowsill?", "Why do cats knead blankets?"]
    (tmp_path / "questions.jsonl").write_text("".join(
        json.dumps({"seed": "s", "text": t, "group": "self:x"}) + "\n" for t in copies + ok))
    generate_dataset(lm, tmp_path, 40, fingerprint=verifier_fingerprint(lm.model), batch=4,
                     max_answer=4, shard_tokens=10_000)
    keys = done_keys(tmp_path)
    assert {Prompt("self", t).key for t in ok} <= keys
    assert not {Prompt("self", t).key for t in copies} & keys


def test_a_dataset_archive_opens_as_a_directory_of_its_records(tmp_path):
    import tarfile

    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "manifest.json").write_text(json.dumps({"verifier": "tiny:1", "shards": []}))
    (ds / "questions.jsonl").write_text(json.dumps({"text": "Why is snow white?"}) + "\n")
    np.save(ds / "shard-00000.hidden.npy", np.zeros(3))
    with tarfile.open(tmp_path / "ds.tar.xz", "w:xz") as tar:
        tar.add(ds, arcname="ds")
    with S.open_dataset(tmp_path / "ds.tar.xz") as root:
        assert S.dataset_verifier(root) == "tiny:1"
        assert list(S.dataset_prompts(root)) == [("Why is snow white?", "questions")]
        assert not list(root.glob("*.hidden.npy"))  # hidden states are never unpacked
    assert S.archive_questions(tmp_path / "ds.tar.xz") == ["Why is snow white?"]
    assert S.user_turn("<|im_start|>system\nx<|im_end|>\n<|im_start|>user\nHi there<|im_end|>"
                       "\n<|im_start|>assistant\n") == "Hi there"
    with pytest.raises(ValueError, match="not a dataset"):
        with S.open_dataset(tmp_path / "nope.txt"):
            pass


def test_a_conversation_is_encoded_through_the_chat_template():
    from macfleet.engine.models import load_model
    from macfleet.engine.text import PromptError, encode_prompt

    tok = load_model("tiny:1").tokenizer  # no chat template: contents joined
    conv = (Turn("user", "hi"), Turn("assistant", "hello"), Turn("user", "again"))
    assert encode_prompt(tok, conv, chat=False) == tok.encode("hi\nhello\nagain")
    with pytest.raises(PromptError, match="user turn"):
        encode_prompt(tok, conv[:2], chat=True)
    with pytest.raises(ValueError, match="role"):
        Turn("bot", "x")


@pytest.mark.slow  # loads the embedded model
def test_a_rendered_conversation_encodes_to_the_templates_ids():
    """The bench sends a conversation to the verifier agent as its chat-template text (the
    wire carries text): encoded there, it must be the ids the template gives in-process."""
    from macfleet.engine.conversation import render
    from macfleet.engine.models import load_model
    from macfleet.engine.text import encode_prompt

    lm = load_model("smollm2")
    conv = HELD_OUT["followup"]
    ids = encode_prompt(lm.tokenizer, conv, chat=True)
    assert list(lm.tokenizer.encode(render(lm.tokenizer, conv))) == ids
    assert lm.tokenizer.decode(ids).count("<|im_start|>user") == 2


@pytest.mark.slow  # generates a small dataset and runs the bench on every held-out prompt
def test_bench_drafter_records_each_prompts_contamination_and_what_changed(tmp_path):
    import subprocess
    import sys

    from macfleet.distill.dataset import generate_dataset
    from macfleet.engine.proposers.eagle.head import verifier_fingerprint
    from macfleet.engine.models import load_model

    lm = load_model("tiny:1")
    ds = tmp_path / "ds"
    generate_dataset(lm, ds, 300, fingerprint=verifier_fingerprint(lm.model), batch=4,
                     max_answer=12, shard_tokens=100_000)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "macfleet", "bench", "--model", "tiny:1", "--out", str(out),
           "drafter", "--proposer", "ngram", "--no-agents", "--max-tokens", "12",
           "--dataset", str(ds)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    doc = json.loads((out / "drafter.json").read_text())
    assert doc["held_out_changes"] == HELD_OUT_CHANGES
    assert doc["held_out_prompts"]["followup"][1]["role"] == "assistant"
    c = doc["contamination"]
    # the shards' user turns were read (most decode, through the tiny tokenizer, to a
    # templated prompt already indexed: each text is indexed once)
    assert c["dataset"] == str(ds) and c["training_prompts"].get("shards", 0) >= 1
    assert set(c["prompts"]) == set(HELD_OUT)
    for kind, r in c["prompts"].items():
        assert 0 < r["nearest_ratio"] <= C.NEAR_COPY and r["near_copies"] == 0
        assert r["answer_in_store"] is None  # a tiny model ships no answer store
        share = r["answer_in_training_data"]
        assert share["ngrams"] == 12 - C.NGRAM + 1 or share["ngrams"] <= 5  # distinct grams
        assert 0 <= share["best_answer_share"] <= share["share"] <= 1
        assert r["changed"] == HELD_OUT_CHANGES.get(kind)
