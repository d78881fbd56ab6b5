"""Self-instruct: the verifier's own questions as distillation prompts."""

import json

from macfleet.engine.drafter.prompts import HELD_OUT, HELD_OUT_SUBJECTS, iter_prompts, Prompt
from macfleet.engine.drafter.self_instruct import (QUESTIONS, generate_questions, parse_list,
                                                   read_questions, seeds)
from macfleet.engine.models import load_model


def test_parse_list_keeps_requests_and_drops_headings_repeats_and_held_out_subjects():
    text = """Here are some questions:

1. What's the best type of soil for my plants?
2. **How do I prune my roses?**
3. How do I prune my roses?
4. Destination: How can I visit a coral reef?
5. Interview: 5
6. Can you provide a list of 10 different questions about gardening?
7. What should I bring on a camping trip?
8. Explain how compost turns into soil
9. The weather is nice today.
10) "Write a short poem about tomatoes."
"""
    assert parse_list(text) == ["What's the best type of soil for my plants?",
                                "How do I prune my roses?",
                                "Explain how compost turns into soil",
                                "Write a short poem about tomatoes."]
    assert parse_list("") == [] and parse_list("no list here?") == []


def test_seeds_are_deterministic_distinct_and_never_name_a_held_out_subject():
    a, b = seeds(), seeds()
    assert a == b and len(a) > 1500
    assert len({s.key for s in a}) == len(a)  # rounds of one request are distinct seeds
    assert not any(h in s.text.lower() for s in a for h in HELD_OUT_SUBJECTS)
    assert len(seeds(rounds=1)) * 3 == len(a)


def test_questions_are_a_source_of_their_own_and_held_out_requests_stay_out():
    extra = [Prompt("self", f"How do I look after plant number {i}?", "self:plants")
             for i in range(50)] + [Prompt("self", HELD_OUT["chat"], "self:x")]
    got = [p for _, p in zip(range(300), iter_prompts(seed=1, extra=extra))]
    mine = [p for p in got if p.source == "self"]
    assert len(mine) == 50  # every question once; the held-out request dropped
    assert HELD_OUT["chat"] not in {p.text for p in got}
    assert {p.source for p in got} > {"self", "chat", "topics"}
    without = [p for _, p in zip(range(100), iter_prompts(seed=1))]
    assert not any(p.source == "self" for p in without)


def test_generate_questions_appends_and_resumes_after_the_seeds_asked(tmp_path):
    lm = load_model("tiny:2:32")  # random weights: its lists are noise, kept or not
    a = generate_questions(lm, tmp_path, 6, batch=4, max_tokens=12)
    assert a.seeds == 6
    rows = [json.loads(line) for line in (tmp_path / QUESTIONS).read_text().splitlines()]
    assert len({r["seed"] for r in rows}) == 6  # every seed recorded, with or without questions
    assert [p.text for p in read_questions(tmp_path)] == [r["text"] for r in rows if r["text"]]
    again = generate_questions(lm, tmp_path, 6, batch=4, max_tokens=12)
    assert again.seeds == 0  # nothing asked twice
    more = generate_questions(lm, tmp_path, 9, batch=4, max_tokens=12)
    assert more.seeds == 3
    with open(tmp_path / QUESTIONS, "a") as f:
        f.write('{"seed": "cut')  # a line cut by a stopped run
    assert len(read_questions(tmp_path)) == more.total


def test_a_seed_whose_questions_are_all_known_is_still_recorded_as_asked(tmp_path, monkeypatch):
    import macfleet.engine.drafter.self_instruct as si

    same = "1. How do I start a vegetable garden?\n2. What should I plant in spring?"
    monkeypatch.setattr(si, "sample_lists", lambda lm, texts, **kw: [same] * len(texts))
    a = generate_questions(None, tmp_path, 3, batch=3)
    assert a.seeds == 3 and a.questions == 2 and a.total == 2  # the 2nd and 3rd add nothing
    rows = [json.loads(line) for line in (tmp_path / QUESTIONS).read_text().splitlines()]
    assert len({r["seed"] for r in rows}) == 3
    assert generate_questions(None, tmp_path, 3, batch=3).seeds == 0  # none asked again
