"""Self-instruct: the verifier's own questions as distillation prompts."""

import json
import zlib

from macfleet.distill.prompts import HELD_OUT, HELD_OUT_SUBJECTS, iter_prompts, Prompt
from macfleet.distill.self_instruct import (QUESTIONS, SUBTOPICS, Subject,
                                            generate_questions, parse_list,
                                            parse_subjects, read_questions,
                                            read_subjects, seeds)
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
    import macfleet.distill.self_instruct as si

    same = "1. How do I start a vegetable garden?\n2. What should I plant in spring?"
    monkeypatch.setattr(si, "sample_lists", lambda lm, texts, **kw: [same] * len(texts))
    a = generate_questions(None, tmp_path, 3, batch=3)
    assert a.seeds == 3 and a.questions == 2 and a.total == 2  # the 2nd and 3rd add nothing
    rows = [json.loads(line) for line in (tmp_path / QUESTIONS).read_text().splitlines()]
    assert len({r["seed"] for r in rows}) == 3
    assert generate_questions(None, tmp_path, 3, batch=3).seeds == 0  # none asked again


def test_parse_subjects_keeps_names_from_what_a_small_verifier_writes():
    text = """Here's a numbered list of 10 specific subtopics of dogs:

1. Dogs (Canis lupus)
2. **Dog breeds**
3. Dog health
4. dog breeds
5. Key Management: The process of managing keys.
6. Leavening agents - what makes bread rise
7. 1.1.1: Saving for College
8. The camping gear a dog needs
- Dog training
* Pawns in the Game
9. An extremely long name that goes on far too long to be a subject
"""
    assert parse_subjects(text, "dogs") == ["Dog breeds", "Dog health", "Key Management",
                                            "Leavening agents", "Dog training",
                                            "Pawns in the Game"]
    assert parse_subjects("1. The Roman Empire\n2. Pax Romana", "the Roman Empire") == [
        "Pax Romana"]


def _fake_lists(lm, texts, **kw):
    """A verifier whose subtopic lists name two children and whose question lists hold one
    question about the subject (so every seed adds exactly one question; numbered by a hash that
    is the same in every process: str.__hash__ is salted per process, and when two seeds drew
    the same number their questions were one, and the test failed now and then)."""
    out = []
    for t in texts:
        subject = t.rsplit(" of ", 1)[-1].rstrip(".") if "subtopics" in t \
            else t.rsplit(" about ", 1)[-1].rstrip(".")
        if "subtopics" in t:
            out.append(f"1. {subject} care\n2. {subject} history\n3. {subject}")
        else:
            out.append(f"1. What should I know about {subject} #{zlib.crc32(t.encode()) % 97}?")
    return out


def test_when_the_seeds_run_out_the_verifier_names_subtopics_breadth_first(tmp_path,
                                                                            monkeypatch):
    import macfleet.distill.self_instruct as si

    monkeypatch.setattr(si, "sample_lists", _fake_lists)
    monkeypatch.setattr(si, "listed_subjects", lambda: [Subject("dogs", "dogs"),
                                                        Subject("tea", "tea")])
    base = len(seeds(rounds=1))
    assert base == 4  # 2 subjects x 2 asks
    a = generate_questions(None, tmp_path, base + 3, batch=8, rounds=1)
    assert a.seeds == base + 3 and a.subjects == 4  # dogs care/history, tea care/history
    got = read_subjects(tmp_path)
    assert [s.name for s in got.found] == ["dogs care", "dogs history", "tea care",
                                           "tea history"]
    assert {s.group for s in got.found} == {"self:dogs", "self:tea"}  # the listed root's group
    assert {s.depth for s in got.found} == {1} and got.expanded == {"dogs", "tea"}
    qs = read_questions(tmp_path)
    assert len(qs) == base + 3 and {p.group for p in qs} == {"self:dogs", "self:tea"}
    # resumes: the subtopics already named are not asked again; depth 2 comes after depth 1
    b = generate_questions(None, tmp_path, base + 8 + 2, batch=8, rounds=1)
    assert b.seeds == 7 and b.subjects == 8  # one wave asked all four depth-1 subjects
    assert [s.depth for s in read_subjects(tmp_path).found] == [1] * 4 + [2] * 8
    # max_depth bounds the tree: with nothing left to expand, it stops short of the ask
    c = generate_questions(None, tmp_path, 1000, batch=8, rounds=1, max_depth=2)
    assert c.subjects == 0 and c.seeds == 8 * 2 - 2  # the depth-2 subjects' remaining seeds
    assert generate_questions(None, tmp_path, 1000, batch=8, rounds=1, max_depth=2).seeds == 0


def test_subtopics_file_survives_a_cut_line_and_held_out_subjects_stay_out(tmp_path):
    (tmp_path / SUBTOPICS).write_text(
        json.dumps({"parent": "dogs", "subject": "Dog training", "root": "dogs",
                    "depth": 1}) + "\n"
        + json.dumps({"parent": "dogs", "subject": "", "root": "dogs", "depth": 1}) + "\n"
        + '{"parent": "tea", "subj')
    got = read_subjects(tmp_path)
    assert [s.name for s in got.found] == ["Dog training"] and got.expanded == {"dogs"}
    assert parse_subjects("1. Camping stoves\n2. Fridge magnets\n3. Dog food", "dogs") == [
        "Dog food"]
