"""Structured output that fits the budget (issue 43): the default JSON grammar allows only the
whitespace of a compact or conventionally indented document (a schema's `x-guidance` still
overrides it), and `strict: true` refuses properties the schema does not name. Checked token
by token with an ASCII tokenizer, no model."""

from __future__ import annotations

import json

import pytest
from serve_testkit import ASCII, VOCAB

from macfleet.engine.constraint import JSON_OBJECT, JSON_SCHEMA, Constraint, Grammar, schema_text
from macfleet.engine.json_schema import StrictSchemaError, strict_schema
from macfleet.serve.schemas import Limits, RequestError, parse_request
from macfleet.serve.tools import AUTO, HERMES, ToolChoice, tool_grammar

PERSON = {"type": "object", "required": ["name", "age", "tags", "home"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "home": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}}}
DOC = {"name": "Ada", "age": 36, "tags": ["x", "y"], "home": {"city": "London"}}


def _takes(grammar: Grammar, text: str) -> bool:
    ids = ASCII.encode(text)
    return Constraint(grammar, ASCII, VOCAB).cut(ids) == len(ids)


def _schema(schema: dict) -> Grammar:
    return Grammar(JSON_SCHEMA, schema_text(schema))


GOOD = [json.dumps(DOC, separators=(",", ":")), json.dumps(DOC),  # compact, ", " and ": "
        json.dumps(DOC, indent=2), json.dumps(DOC, indent=4)]
WASTE = ['{\n' + " " * 40 + '"name": "Ada"',  # an indentation no document has
         '{"name": "Ada"\n\n,\n"age": 36',  # blank lines around a comma
         '{\n\n  "name": "Ada"',  # a blank line
         '{"name":  "Ada"',  # two spaces
         '{"name": "Ada", "age": 36' + " " * 20]


@pytest.mark.parametrize("grammar", [_schema(PERSON), Grammar(JSON_OBJECT)],
                         ids=["json_schema", "json_object"])
def test_default_json_grammar_allows_compact_or_indented_whitespace_only(grammar):
    for text in GOOD:
        assert _takes(grammar, text), text
    for text in WASTE:
        assert not _takes(grammar, text), text


def test_a_schemas_own_x_guidance_overrides_the_whitespace_options():
    loose = _schema({**PERSON, "x-guidance": {"whitespace_flexible": True}})
    assert all(_takes(loose, t) for t in GOOD + WASTE[:1])
    tight = _schema({**PERSON, "x-guidance": {"whitespace_flexible": False}})
    assert _takes(tight, GOOD[0]) and not _takes(tight, GOOD[2])


def test_an_answer_beside_tools_gets_the_same_whitespace_options():
    body = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": PERSON}}}
    r = parse_request(body, chat=True, limits=Limits())
    g = tool_grammar(HERMES, r.tools, ToolChoice(AUTO), r.grammar)
    assert _takes(g, GOOD[2]) and not _takes(g, WASTE[0])


# -- strict: true ---------------------------------------------------------------------------------
def _request(strict, schema=PERSON):
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": strict}}
    return parse_request({"messages": [{"role": "user", "content": "hi"}],
                          "response_format": rf}, chat=True, limits=Limits())


EXTRA_TOP = json.dumps({**DOC, "proper_name": "Ada L."})
EXTRA_NESTED = json.dumps({**DOC, "home": {"city": "London", "type": "string"}})


def test_strict_json_schema_refuses_properties_the_schema_does_not_name():
    loose, strict = _request(False).grammar, _request(True).grammar
    for text in (EXTRA_TOP, EXTRA_NESTED):
        assert _takes(loose, text) and not _takes(strict, text), text
    assert _takes(strict, json.dumps(DOC))


def test_strict_schema_reaches_every_object_and_refuses_open_ones():
    s = strict_schema({"type": "object", "properties": {
        "a": {"type": "array", "items": {"$ref": "#/$defs/p"}},
        "b": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]}},
        "$defs": {"p": {"properties": {"y": {"type": "integer"}}}}})
    assert s["additionalProperties"] is False
    assert s["$defs"]["p"]["additionalProperties"] is False
    assert s["properties"]["b"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["b"]["anyOf"][1]
    with pytest.raises(StrictSchemaError, match="/properties/o/additionalProperties"):
        strict_schema({"type": "object", "properties": {
            "o": {"type": "object", "additionalProperties": {"type": "string"}}}})
    with pytest.raises(RequestError) as e:
        _request(True, {**PERSON, "additionalProperties": True})
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(RequestError) as e:
        _request("yes")
    assert e.value.param == "response_format.json_schema.strict"


def test_a_strict_functions_enforced_arguments_refuse_unnamed_properties():
    def grammar(strict):
        fn = {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
        if strict is not None:
            fn["strict"] = strict
        r = parse_request({"messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"type": "function", "function": fn}],
                           "tool_choice": "required"}, chat=True, limits=Limits())
        return tool_grammar(HERMES, r.tools, r.tool_choice)

    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"properties": {"Temperature": 1}}}\n</tool_call>')
    assert _takes(grammar(None), call) and not _takes(grammar(True), call)
    ok = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _takes(grammar(True), ok)
