"""`macfleet generate --response-format` through a fleet (issue 32): the verifier agent's batch
masks its rows with the grammar, and a re-plan after a lost verifier resumes the grammar after
the tokens already committed (the new verifier's constraint advances over them first) instead
of restarting it -- the answer is constrained plain decoding's, bit for bit.

Real agents in this process (real sockets, CURVE, the tiny random model); the tiny character
tokenizer has no braces, so the grammar is a regex here (JSON on smollm2: test_structured.py).
"""

from __future__ import annotations

import json
import re

import pytest

from agents.daemon import Agent, AgentConfig
from macfleet.cli import cmd_generate
from macfleet.cli.common import UserError
from macfleet.cli.main import build_parser
from macfleet.engine.constraint import REGEX, Grammar
from macfleet.engine.events import Finished
from macfleet.engine.models import load_model
from reference_loops import generate_local
from macfleet.fleet import client

KEY = b"g" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed
MODEL = "tiny:1"
PROMPT = "the cat sat on the mat"
# literal runs ("id: ", "; n ") are forced tokens under the tiny character tokenizer
PATTERN = r"id: [a-z]{2,6}; n [0-9]{1,3}\."
FORMAT = json.dumps({"type": "regex", "regex": PATTERN})
MAX_TOKENS = 40


def _args(*extra: str):
    return build_parser().parse_args(
        ["generate", PROMPT, "--model", MODEL, "--no-chat", "--proposer", "ngram",
         "--draft-tokens", "2", "--max-tokens", str(MAX_TOKENS), "--json", "--wait", "0.1",
         *extra])


def _reference() -> list[int]:
    """Constrained plain decoding in-process: the verifier alone under the grammar."""
    lm = load_model(MODEL)
    fin = list(generate_local(lm, PROMPT, chat=False, proposer="none", max_tokens=MAX_TOKENS,
                              grammar=Grammar(REGEX, PATTERN)))[-1]
    assert isinstance(fin, Finished) and fin.stats.finish_reason == "stop"
    return list(fin.token_ids)


def _agent(role: str) -> Agent:
    return Agent(AgentConfig(role=role, model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL))


def _fleet(monkeypatch, cards, prefer=None) -> list[dict]:
    """The CLI sees these cards (`prefer`'s node first); returns generate()'s calls."""
    monkeypatch.setattr(client, "members", lambda *a, **k: list(cards))
    monkeypatch.setattr("macfleet.fleet.keys.resolve_key", lambda *a, **k: KEY)
    real_probe, real_generate = client.probe, client.generate
    calls: list[dict] = []

    def probe(card, key, **kw):  # `prefer` looks fastest: it is chosen first
        st = real_probe(card, key, **kw)
        return client.AgentStatus(st.card, st.status,
                                  (0.01,) if card.node_id == prefer else (50.0,))

    def generate(verifier, key, **kw):
        calls.append({"verifier": verifier.name, "prefix_ids": list(kw["prefix_ids"]),
                      "grammar": kw.get("grammar")})
        return real_generate(verifier, key, **kw)

    monkeypatch.setattr(client, "probe", probe)
    monkeypatch.setattr(client, "generate", generate)
    return calls


def test_response_format_goes_through_the_fleet_and_equals_in_process(monkeypatch, capsys):
    want = _reference()
    v, p = _agent("verifier"), _agent("proposer")
    try:
        calls = _fleet(monkeypatch, [v.card, p.card])
        assert cmd_generate.run(_args("--response-format", FORMAT)) == 0
        doc = json.loads(capsys.readouterr().out)
    finally:
        for a in (v, p):
            a.close()
    # through the verifier agent (not in-process), with the grammar on the wire
    assert [c["grammar"] for c in calls] == [(REGEX, PATTERN)]
    assert doc["stats"]["fleet"]["verifier_agent"] == v.name
    assert doc["token_ids"] == want  # bit-identical to constrained plain decoding
    assert re.fullmatch(PATTERN, doc["text"]), doc["text"]


RESUME_AT = 5  # the first verifier fails once an iteration starts with this many tokens out


def test_a_replan_resumes_the_grammar_after_the_committed_tokens(monkeypatch, capsys):
    """The first verifier's batch breaks mid-answer (an engine error: its request fails with
    INTERNAL, as when it loses its hardware); the second one gets the committed tokens as
    prefix_ids and must go on inside the grammar from there. A constraint restarted from the
    grammar's beginning would answer `id: ab` + `id: ...` (or refuse), never this."""
    want = _reference()
    bad, good, p = _agent("verifier"), _agent("verifier"), _agent("proposer")
    engine = bad.verifier._batch
    real_iteration = engine._iteration

    def breaks(batch):
        if any(len(s.generated) >= RESUME_AT for s in batch):
            raise RuntimeError("rank 1 vanished")
        return real_iteration(batch)

    engine._iteration = breaks
    try:
        calls = _fleet(monkeypatch, [bad.card, good.card, p.card], prefer=bad.node_id)
        assert cmd_generate.run(_args("--response-format", FORMAT)) == 0
        out = capsys.readouterr()
        doc = json.loads(out.out)
    finally:
        for a in (bad, good, p):
            a.close()
    assert "re-planning" in out.err
    assert [c["verifier"] for c in calls] == [bad.name, good.name]
    prefix = calls[1]["prefix_ids"]
    assert RESUME_AT <= len(prefix) < len(want)  # mid-answer: the grammar neither new nor done
    assert prefix == want[:len(prefix)]
    assert doc["token_ids"] == want, (doc["text"], len(prefix))
    assert re.fullmatch(PATTERN, doc["text"]), doc["text"]
    assert doc["stats"]["fleet"]["verifier_agent"] == good.name


def test_a_prefix_that_breaks_the_grammar_is_refused_clearly(monkeypatch):
    """A re-plan whose committed tokens cannot follow the grammar (here: made up) is refused by
    the verifier agent with a message naming the token, a UserError at the CLI."""
    lm = load_model(MODEL)
    v = _agent("verifier")
    try:
        _fleet(monkeypatch, [v.card])
        with pytest.raises(client.Refused, match="do not follow the grammar: token 0"):
            list(client.generate(v.card, KEY, prompt=PROMPT, chat=False, max_tokens=20,
                                 prefix_ids=lm.tokenizer.encode("xyz"),
                                 grammar=(REGEX, PATTERN)))
        # the agent keeps serving: the same request with a prefix that follows it
        good = list(client.generate(v.card, KEY, prompt=PROMPT, chat=False, max_tokens=20,
                                    prefix_ids=lm.tokenizer.encode("id: "),
                                    grammar=(REGEX, PATTERN)))
    finally:
        v.close()
    text = "id: " + "".join(e.text for e in good if isinstance(e, client.Text))
    assert re.fullmatch(PATTERN, text), text


@pytest.mark.parametrize("fmt, says", [
    ('{"type": "regex", "regex": "(("}', "response_format.regex"),
    ("not json", "--response-format is not JSON"),
    ('{"type": "yaml"}', "response_format.type"),
])
def test_a_bad_response_format_fails_before_any_network_a_good_one_asks_the_fleet(
        monkeypatch, capsys, fmt, says):
    looked: list[str] = []

    def discover(*a, **k):
        looked.append("discover")
        return []  # no agents: the in-process fallback answers

    monkeypatch.setattr(client, "members", discover)
    monkeypatch.setattr("macfleet.fleet.keys.resolve_key", lambda *a, **k: KEY)
    with pytest.raises(UserError, match=re.escape(says)):
        cmd_generate.run(_args("--response-format", fmt))
    assert looked == []  # refused before discovery (and before loading the model)
    # a good one looks for the fleet (no longer in-process only); none found: in-process
    assert cmd_generate.run(_args("--response-format", FORMAT)) == 0
    assert looked == ["discover"]
    doc = json.loads(capsys.readouterr().out)
    assert doc["token_ids"] == _reference() and doc["stats"]["fleet"] is None


# -- JSON on the embedded smollm2 (the tiny tokenizer has no braces) ------------------------
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "enum": ["Paris", "London", "Rome"]}}}


@pytest.mark.slow  # smollm2 on the CPU: three agents in this process share one loaded model
def test_json_through_the_fleet_and_across_a_replan_on_smollm2(monkeypatch, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    from macfleet.serve.schemas import response_format

    import macfleet.engine.verify_costs as vc

    from agents import warmup

    model, n = "smollm2", 80
    lm = load_model(model)
    # a fixed verify(L) table, as on a machine that measured it once (the probe was a third
    # of this test's time), and a greedy answer is the same whatever lengths are drafted;
    # the verifier agents start without their warm-up (each length's first forward, `auto`'s
    # drafters and their answer store built: over a third of the rest, and no part of a
    # re-plan; the warm-up on smollm2 is test_warm_start.py's)
    monkeypatch.setattr(vc, "_memo", {})
    vc._remember(lm.model, {L: 10.0 + 0.2 * (L - 1) for L in (1, 2, 4, 8, 16, 32, 64)})
    monkeypatch.setattr(warmup, "warm_verifier", lambda lm: warmup.Warmed(False, (), (), 0.0))
    # the breaking verifier first, then the good one: a re-plan mid-object (an ask of the
    # good verifier alone, json_object, went: a grammar through the fleet is
    # test_response_format_goes_through_the_fleet_and_equals_in_process's on the tiny model, the
    # wire carries any kind as its two strings, and json_object on smollm2 is the serving
    # engine's in test_structured_trees.py: docs/testing.md, ninth round)
    asks = [("Describe a person called Alice who is 30 and lives in Paris.",
             {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})]

    def reference(prompt, fmt):
        fin = list(generate_local(lm, prompt, proposer="none", max_tokens=n,
                                  grammar=response_format(fmt)))[-1]
        assert fin.stats.finish_reason == "stop"
        return list(fin.token_ids)

    def cfg(role):
        return Agent(AgentConfig(role=role, model=model, key=KEY, advertise=False,
                                 allow_peers=LOCAL))

    bad, good = cfg("verifier"), cfg("verifier")
    engine = bad.verifier._batch
    real_iteration = engine._iteration

    def breaks(batch):
        if any(len(s.generated) >= 6 for s in batch):
            raise RuntimeError("rank 1 vanished")
        return real_iteration(batch)

    engine._iteration = breaks
    docs = []
    try:
        calls = _fleet(monkeypatch, [bad.card, good.card], prefer=bad.node_id)
        for prompt, fmt in asks:
            args = build_parser().parse_args(
                ["generate", prompt, "--model", model, "--proposer", "ngram", "--max-tokens",
                 str(n), "--json", "--wait", "0.1", "--response-format", json.dumps(fmt)])
            assert cmd_generate.run(args) == 0
            docs.append(json.loads(capsys.readouterr().out))
    finally:
        for a in (bad, good):
            a.close()
    for (prompt, fmt), doc in zip(asks, docs):
        assert doc["token_ids"] == reference(prompt, fmt), doc["text"]
        assert doc["stats"]["fleet"]["verifier_agent"] == good.name
    jsonschema.validate(json.loads(docs[0]["text"]), PERSON)
    assert [c["verifier"] for c in calls] == [bad.name, good.name]
    assert 6 <= len(calls[1]["prefix_ids"]) < len(docs[0]["token_ids"])  # mid-object
