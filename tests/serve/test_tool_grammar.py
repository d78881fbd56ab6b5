"""Enforced tool calls (issue 32): tool_choice "required" or a named function is a grammar on
the verifier's distribution in the template family's tool-call format, each call's arguments a
`%json` of the function's `parameters`; "auto" beside a response_format is an alternation of
the answer and calls. Grammars checked token by token with an ASCII tokenizer (no model), then
the real server with the embedded smollm2 through the `openai` client (slow)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from dataclasses import dataclass

import pytest
from serve_testkit import ASCII, TOOLS_TEMPLATE, VOCAB
from verify_table import keep_verify_table

from macfleet.engine.constraint import (JSON_SCHEMA, MAX_FORCED, REGEX, Constraint, Grammar,
                                        schema_text)
from macfleet.serve.schemas import Limits, RequestError, parse_request
from macfleet.serve.tools import (AUTO, FUNCTION, HERMES, LLAMA3, MISTRAL, REQUIRED, ToolChoice,
                                  parse_tool_calls, tool_grammar)

FORECAST = {"type": "object", "additionalProperties": False,
            "required": ["city", "start", "days", "unit"],
            "properties": {"city": {"type": "string", "enum": ["PAR", "LON", "ROM"],
                                    "description": "the city's airport code"},
                           "start": {"type": "string",
                                     "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "unit": {"type": "string", "enum": ["C", "F"]}}}
CLOCK = {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
         "required": ["zone"], "additionalProperties": False,
         "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST,
                                           "description": "Weather forecast for a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK,
                                           "description": "The time in a time zone"}}]
SCHEMAS = {"get_forecast": FORECAST, "get_time": CLOCK}
NAMED = {"type": "function", "function": {"name": "get_time"}}
ANSWER = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "string", "maxLength": 40}}}


def _req(**kw):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw}
    return parse_request(body, chat=True, limits=Limits())


def _constraint(fmt, choice, answer=None, parallel=True):
    r = _req()
    return Constraint(tool_grammar(fmt, r.tools, choice, answer, parallel), ASCII, VOCAB)


def _call(fmt, name, args):
    key = "parameters" if fmt == LLAMA3 else "arguments"
    obj = json.dumps({"name": name, key: args})
    return f"<tool_call>\n{obj}\n</tool_call>" if fmt == HERMES else obj


def _calls(fmt, *calls):
    body = {HERMES: "\n", LLAMA3: "; ", MISTRAL: ", "}[fmt].join(_call(fmt, *c) for c in calls)
    return f"[TOOL_CALLS][{body}]" if fmt == MISTRAL else body


PARIS = ("get_forecast", {"city": "PAR", "start": "2026-11-28", "days": 3, "unit": "C"})
UTC = ("get_time", {"zone": "UTC"})


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_required_grammar_takes_valid_calls_in_the_family_format_and_nothing_else(fmt):
    text = _calls(fmt, PARIS, UTC)
    c = _constraint(fmt, ToolChoice(REQUIRED))
    ids = ASCII.encode(text)
    assert c.cut(ids) == len(ids)  # two calls, as the template writes them
    _, calls = parse_tool_calls(fmt, text)
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [PARIS, UTC]
    for bad in (_calls(fmt, ("get_forecast", {**PARIS[1], "city": "Paris"})),
                _calls(fmt, ("get_forecast", {**PARIS[1], "days": 9})),
                _calls(fmt, ("get_forecast", {**PARIS[1], "start": "tomorrow"})),
                _calls(fmt, ("get_forecast", {"city": "PAR", "start": "2026-11-28", "unit": "C"})),
                _calls(fmt, ("get_weather", {})),  # no such function
                _calls(fmt, ("get_time", {"zone": "PST"})),  # a $ref'd enum
                "Sure, the weather in Paris is"):  # free text: no call
        bad_ids = ASCII.encode(bad)
        assert c.cut(bad_ids) < len(bad_ids), bad
    if fmt == MISTRAL:  # the list's "]" closes it: the answer ends there
        assert c.commit(ids) == len(ids) and c.done
        return
    # another call may follow: end-of-sequence allowed, not forced
    assert c.commit(ids) is None and not c.done
    assert c.masks([])[0][next(iter(ASCII.eos_token_ids))]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_named_grammar_is_one_call_to_that_function_its_opening_forced(fmt):
    c = _constraint(fmt, ToolChoice(FUNCTION, "get_time"))
    text = _calls(fmt, UTC)
    opening = text[:text.index("UTC")]  # the markers, the name, the keys: drafted for free
    assert ASCII.decode(c.forced()) == opening[:MAX_FORCED]
    one = ASCII.encode(_calls(fmt, UTC))
    assert c.cut(ASCII.encode(_calls(fmt, PARIS))) < len(ASCII.encode(_calls(fmt, PARIS)))
    two = ASCII.encode(_calls(fmt, UTC, UTC))
    assert c.cut(two) < len(two)  # exactly one call
    assert c.commit(one) == len(one) and c.done  # complete: the answer ends there
    # parallel_tool_calls false: "required" is one call too
    c = _constraint(fmt, ToolChoice(REQUIRED), parallel=False)
    assert c.cut(two) < len(two) and c.commit(one) == len(one)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_auto_beside_a_response_format_is_the_answer_or_calls(fmt):
    for answer, good, bad in (
            (Grammar(JSON_SCHEMA, schema_text(ANSWER)), '{"answer": "sunny"}',
             '{"answer": 3}'),
            (Grammar(REGEX, r"(yes|no)/[0-9]+"), "no/42", "maybe")):
        c = _constraint(fmt, ToolChoice(AUTO), answer)
        for text in (good, _calls(fmt, PARIS)):
            assert c.cut(ASCII.encode(text)) == len(text), text
        assert c.cut(ASCII.encode(bad)) < len(bad)
        _, calls = parse_tool_calls(fmt, good)
        assert calls == ()  # the answer is content


@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tool_choice=NAMED, response_format={"type": "json_object"}), "response_format"),
    (dict(response_format={"type": "grammar", "grammar": 'start: "a"'}), "response_format"),
    (dict(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "foo"}}}}}]),
     "tools[0].function.parameters"),
    (dict(tool_choice="required", parallel_tool_calls="no"), "parallel_tool_calls"),
])
def test_combinations_the_grammar_cannot_honour_are_a_400_naming_the_field(kw, param):
    with pytest.raises(RequestError) as e:
        _req(**kw)
    assert e.value.param == param and e.value.status == 400, e.value.message


def test_what_the_grammar_does_not_enforce_is_not_refused():
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "foo"}}}}}, *TOOLS]
    assert _req(tools=odd).tool_choice.mode == AUTO  # auto: the template asks, nothing checks
    r = _req(tools=odd, tool_choice=NAMED)  # only the named function's schema is compiled
    assert r.tool_choice == ToolChoice(FUNCTION, "get_time")
    r = _req(response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                      "schema": ANSWER}})
    assert r.tool_choice.mode == AUTO and r.grammar.kind == JSON_SCHEMA


# -- the real server: smollm2 with a Hermes template, the `openai` client ---------------------
QUESTION = [{"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "Will it rain in Paris this week?"}]


@pytest.fixture(scope="module")
def smollm2_here():
    """smollm2 in this process (the plain-decoding reference below needs it), its verify(L)
    table measured here and kept in the run's cache before the server starts, so the server
    reads it: one measurement for the module, not one in each process (tests/verify_table.py)."""
    from macfleet.engine.models import embedded_model_path

    if embedded_model_path() is None:
        pytest.skip("the embedded smollm2 is not installed")
    return keep_verify_table("smollm2")


@pytest.fixture(scope="module")
def smollm2(smollm2_here, smollm2_server):
    """The shared smollm2 server (conftest.py: this template, one per test process)."""
    pytest.importorskip("jsonschema")
    import openai  # ~1.6 s an import: the module's fast tests need none

    s = smollm2_server
    return s, openai.OpenAI(base_url=s.v1, api_key=s.key, max_retries=0, timeout=300)


# every smollm2 answer's cap: the weather question's first call (get_forecast, its four
# arguments) is 58 tokens, so "required" (which repeats calls) still returns a complete call and
# finish_reason "length", and a single call ends before it; was 80, the batch's longest answer
MAX_TOKENS = 64


def _ask(c, choice, stream=False, messages=QUESTION, **kw):
    args = dict(model="smollm2", messages=messages, tools=TOOLS, tool_choice=choice,
                temperature=0, max_tokens=MAX_TOKENS, **kw)
    if not stream:
        ch = c.chat.completions.create(**args).choices[0]
        calls = ch.message.tool_calls or []
        return ch.finish_reason, [(x.function.name, x.function.arguments) for x in calls]
    parts, finish = {}, None
    for chunk in c.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            name, args_ = parts.get(d.index, ("", ""))
            parts[d.index] = (name + (d.function.name or ""), args_ + (d.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return finish, [parts[i] for i in sorted(parts)]


def _valid(calls, names=tuple(SCHEMAS)) -> None:
    import jsonschema

    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(json.loads(args), SCHEMAS[name])


OFF_TOPIC = [{"role": "user", "content": "What is 2+2?"}]
# (tool_choice, the functions it allows, messages)
CASES = [(choice, names, messages)
         for choice, names in (("required", tuple(SCHEMAS)), (NAMED, ("get_time",)))
         for messages in (QUESTION, OFF_TOPIC)]
AUTO_QUESTIONS = ("Will it rain in Paris this week?", "Say hello to me.")
AUTO_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
# combinations the grammar cannot honour, fired among the others (their 400s: the field)
BAD = [dict(response_format={"type": "json_object"}),
       dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
           "type": "object", "properties": {"x": {"type": "foo"}}}}}])]


@dataclass(frozen=True)
class Served:
    """What the server answered to every smollm2 request of this module's tests."""
    plain: list  # (finish_reason, calls) per CASES entry
    streamed: list  # the same, assembled from the streamed deltas: the weather question's
    one: object  # "required" with parallel_tool_calls false: the choice
    auto: list  # an AUTO_QUESTIONS answer (choice) each: tools beside AUTO_FORMAT
    refused: list  # the param each BAD * 2 request's 400 names (None: not refused)


def _refused(c, kw):
    import openai

    try:
        c.chat.completions.create(**{**dict(model="smollm2", messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", max_tokens=8), **kw})
    except openai.BadRequestError as e:
        return e.body["param"]
    return None


def _weather(per_case: list) -> list:
    """The entries of the CASES that ask the weather question: "required", then named."""
    return [a for (_, _, messages), a in zip(CASES, per_case) if messages is QUESTION]


@pytest.fixture(scope="module")
def served(smollm2) -> Served:
    """Every smollm2 request of the tests below sent at once: the server decodes them in one
    batch (greedy answers do not depend on the batch: test_batch.py::
    test_smollm2_batched_greedy_equals_alone), the longest answer's iterations instead of each
    test's batch one after another (and the "required"/named weather questions, asked by two
    tests, once)."""
    _, c = smollm2
    with cf.ThreadPoolExecutor(len(CASES) + 3 + len(AUTO_QUESTIONS) + 2 * len(BAD)) as ex:
        plain = [ex.submit(_ask, c, choice, messages=messages) for choice, _, messages in CASES]
        # streamed: the weather question's, both choices (the off-topic prompt is about what
        # the grammar forces, not about how deltas assemble: two decodes fewer)
        streamed = [ex.submit(_ask, c, choice, stream=True, messages=messages)
                    for choice, _, messages in CASES if messages is QUESTION]
        one = ex.submit(c.chat.completions.create, model="smollm2", messages=QUESTION,
                        tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                        temperature=0, max_tokens=MAX_TOKENS)
        auto = [ex.submit(c.chat.completions.create, model="smollm2", tools=TOOLS,
                          response_format=AUTO_FORMAT, temperature=0, max_tokens=MAX_TOKENS,
                          messages=[{"role": "user", "content": q}]) for q in AUTO_QUESTIONS]
        refused = [ex.submit(_refused, c, kw) for kw in BAD * 2]
        return Served([f.result() for f in plain], [f.result() for f in streamed],
                      one.result().choices[0], [f.result().choices[0] for f in auto],
                      [f.result() for f in refused])


@pytest.mark.slow  # smollm2 on the CPU
def test_required_and_named_tool_choice_always_call_with_schema_valid_arguments(served):
    """Fails on the old code: asked through the template alone (with the call's opening
    forced), smollm2 wrote a function that does not exist ("2+2") or the schema itself as the
    arguments, or ran on to max_tokens with no call at all."""
    for (choice, names, _), (finish, calls) in zip(CASES, served.plain):
        # "required" allows more calls, which smollm2 repeats to max_tokens: the complete
        # ones are returned and finish_reason says the budget ran out (issue 43)
        assert finish == "tool_calls" or (choice == "required" and finish == "length"), calls
        _valid(calls, names)
    # streamed deltas assemble to the same calls
    assert served.streamed == _weather(served.plain)
    # one call and nothing else (a small model repeats calls when several are allowed)
    r = served.one
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert len(r.message.tool_calls) == 1


@pytest.mark.slow
def test_auto_with_response_format_answers_to_the_schema_or_calls(served):
    import jsonschema

    for r in served.auto:
        if r.message.tool_calls:  # calls as "required": repeated to max_tokens, "length"
            assert r.finish_reason in ("tool_calls", "length")
            _valid([(x.function.name, x.function.arguments) for x in r.message.tool_calls])
        else:
            assert r.finish_reason == "stop", r.message.content
            jsonschema.validate(json.loads(r.message.content), ANSWER)


def plain_tool_calls(choice, *, proposer: str = "none", **kw) -> tuple[list[int], list]:
    """Constrained plain decoding in this process (BatchEngine, greedy, MAX_TOKENS) of the
    weather question with TOOLS and `choice` (and `kw`: parallel_tool_calls, say) on smollm2
    through the Hermes template: the token ids and the (name, arguments) calls they parse to.
    The reference a served call must equal (here and in test_clients.py, through a fleet)."""
    return plain_tool_calls_all([choice], proposer=proposer, **kw)[0]


def plain_tool_calls_all(choices, *, proposer: str = "none",
                         **kw) -> list[tuple[list[int], list]]:
    """`plain_tool_calls` of several choices as one batch of one engine (greedy batched equals
    alone: test_batch.py::test_smollm2_batched_greedy_equals_alone): the iterations of the
    longest answer, not of all of them one after another."""
    from macfleet.engine.events import Finished, TokensCommitted
    from macfleet.engine.models import load_model
    from macfleet.serve.app import _grammar
    from macfleet.serve.engine import BatchEngine, EngineRequest
    from macfleet.serve.prompt import render_prompt

    lm = load_model("smollm2")
    tok = lm.tokenizer
    eng = BatchEngine(lm, proposer=proposer, max_active=len(choices))
    toks: list[list[int]] = [[] for _ in choices]
    for i, choice in enumerate(choices):
        req = _req(messages=QUESTION, tool_choice=choice, temperature=0,
                   max_tokens=MAX_TOKENS, **kw)
        prompt = render_prompt(tok, req, Limits(), TOOLS_TEMPLATE.read_text())
        grammar, where = _grammar(req, prompt)
        assert where == "tool_choice"
        ereq = EngineRequest(prompt.ids, req.params, MAX_TOKENS, frozenset(tok.eos_token_ids),
                             grammar=grammar)
        eng.submit(ereq, lambda ev, t=toks[i]: t.extend(ev.tokens)
                   if isinstance(ev, TokensCommitted) else isinstance(ev, Finished))
    eng.run_until_idle()
    out = []
    for t in toks:
        _, calls = parse_tool_calls(HERMES, tok.decode(t))
        out.append((t, [(x.name, x.arguments) for x in calls]))
    return out


@pytest.mark.slow
def test_enforced_greedy_calls_equal_constrained_plain_decoding_and_bad_combos_beside(smollm2,
                                                                                      served):
    """The server (n-gram drafts, batched with others) gives the calls constrained plain
    decoding gives for the same request; 400s fired meanwhile name the field and change
    nobody's answer. (Through a fleet's verifier agent: test_clients.py's
    test_a_named_tool_call_is_the_one_constrained_plain_decoding_gives.)"""
    s, _ = smollm2
    assert served.refused == ["response_format", "tools[0].function.parameters"] * 2
    assert s.health()["status"] == "ok"
    choices = ("required", NAMED)
    plain = plain_tool_calls_all(choices)
    drafted = plain_tool_calls_all(choices, proposer="ngram")
    answers = _weather(served.plain)
    assert len(answers) == len(choices)
    for (finish, calls), (plain_ids, plain_calls), (ids, _) in zip(answers, plain, drafted):
        assert ids == plain_ids
        assert plain_calls == calls
