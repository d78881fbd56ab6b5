"""OpenAI request bodies -> typed frozen requests, validated once at the edge.

Only what macfleet honours is accepted; a field with a wrong type or range is a 400 that names
the field (`param`), like OpenAI's own errors. Unknown fields are ignored (clients send many:
`user`, `logit_bias`, ...), except those that would change the answer silently (`n` > 1,
`functions`, `echo`, ...), which are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from macfleet.engine.constraint import (JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, Grammar,
                                         grammar_error, schema_text)
from macfleet.engine.json_schema import StrictSchemaError, strict_schema
from macfleet.engine.sampling import MAX_SEED, SamplingParams
from macfleet.serve.logprobs import MAX_TOP_LOGPROBS
from macfleet.serve.tools import (AUTO, FUNCTION, HERMES, NONE, REQUIRED, ToolCall, ToolChoice,
                                   ToolGrammarError, call_schema, json_or_none, tool_grammar)

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 64
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RequestError(ValueError):
    """A request the server refuses; status and OpenAI error fields included."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = (
            message, param, status, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    max_sessions_per_client: int = 16
    # bounds on rendering and tokenising a chat, refused before any of it (a 1 MB body of
    # one-character messages held the event loop while it rendered)
    max_messages: int = 1024
    max_prompt_chars: int = 0  # characters of message content in all; 0: 32 per prompt token

    @property
    def prompt_chars(self) -> int:
        return self.max_prompt_chars or 32 * self.max_prompt_tokens
    max_prediction_tokens: int = 16384  # a request's `prediction` (serve/prediction.py)


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_template(self) -> dict:
        """The message as chat templates read it (arguments as objects, as HF documents)."""
        d: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.loads(c.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: str  # the JSON schema, as JSON text

    def to_template(self) -> dict:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": json.loads(self.parameters)}}


@dataclass(frozen=True)
class GenerationRequest:
    """A chat (`messages`) or completion (`prompt`) request, ready for the engine."""

    model: str | None
    messages: tuple[Message, ...] | None
    prompt: str | None
    max_tokens: int
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # alternatives per token when logprobs are asked for, else None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice(NONE)  # auto when tools are given
    grammar: Grammar | None = None  # response_format; None: free text
    parallel_tool_calls: bool = True  # tool_choice "required": several calls allowed

    @property
    def chat(self) -> bool:
        return self.messages is not None


def _typed(body: Mapping[str, Any], name: str, types: tuple[type, ...], default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types:
        raise RequestError(f"'{name}' must be {types[0].__name__}, got a boolean", param=name)
    if not isinstance(v, types):
        raise RequestError(f"'{name}' must be {types[0].__name__}, got {type(v).__name__}",
                           param=name)
    return v


def _bounded(body: Mapping[str, Any], name: str, types: tuple[type, ...], lo: float, hi: float,
             default: Any) -> Any:
    """`_typed`, and within lo..hi when given."""
    v = _typed(body, name, types, default)
    if v is not None and not lo <= v <= hi:
        raise RequestError(f"'{name}' must be {lo}..{hi}", param=name)
    return v


def text_content(v: Any, where: str) -> str:
    """A message's (or a prediction's) content: a string or a list of text parts."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in v:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(
                    p.get("text"), str):
                raise RequestError("only text content parts are supported", param=where)
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(f"'{where}' must be a string or a list of text parts", param=where)


def _name(v: Any, field: str) -> str:
    if not isinstance(v, str) or not TOOL_NAME.match(v):
        raise RequestError(f"'{field}' must be 1-64 letters, digits, _ or -", param=field)
    return v


def _schema(holder: Mapping[str, Any], key: str, default: dict, where: str) -> dict:
    """`holder[key]` (`where` names the holder: a json_schema or a function), a JSON schema
    object, as strict mode takes it when the holder says `strict: true`: properties it does not
    name refused (engine/json_schema.py)."""
    field = f"{where}.{key}"
    schema = holder.get(key, default)
    if not isinstance(schema, dict):
        raise RequestError(f"'{field}' must be a JSON schema object", param=field)
    strict = holder.get("strict")
    if not isinstance(strict, (bool, type(None))):
        raise RequestError(f"'{where}.strict' must be a boolean", param=f"{where}.strict")
    if not strict:
        return schema
    try:
        return strict_schema(schema)
    except StrictSchemaError as e:
        raise RequestError(f"'{field}': {e}", param=field) from None


def _messages(v: Any, limits: Limits) -> tuple[Message, ...]:
    if not isinstance(v, list) or not v:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    if len(v) > limits.max_messages:
        raise RequestError(f"'messages' has {len(v)} messages; this server's limit is "
                           f"{limits.max_messages}", param="messages", code="too_many_messages")
    out = []
    chars = 0
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}",
                               param=f"messages[{i}].role")
        calls = _message_calls(m.get("tool_calls"), f"messages[{i}].tool_calls") \
            if role == "assistant" else ()
        content = m.get("content")
        content = "" if content is None and calls else text_content(content,
                                                                    f"messages[{i}].content")
        call_id = m.get("tool_call_id") if role == "tool" else None
        if call_id is not None and not isinstance(call_id, str):
            raise RequestError(f"messages[{i}].tool_call_id must be a string",
                               param=f"messages[{i}].tool_call_id")
        chars += len(content) + sum(len(c.arguments) for c in calls)
        if chars > limits.prompt_chars:
            raise RequestError(f"'messages' hold over {limits.prompt_chars} characters; this "
                               f"server's limit is {limits.prompt_chars} (its prompt limit is "
                               f"{limits.max_prompt_tokens} tokens)", param="messages",
                               code="context_length_exceeded")
        out.append(Message(role, content, calls, call_id))
    return tuple(out)


def _message_calls(v: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's earlier `tool_calls`, handed back by the client."""
    if v is None:
        return ()
    if not isinstance(v, list):
        raise RequestError(f"'{where}' must be a list", param=where)
    out = []
    for j, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not isinstance(args, str):
            raise RequestError(f"{where}[{j}] must be {{id, type: function, function: {{name, "
                               "arguments}}}} with string name and arguments",
                               param=f"{where}[{j}]")
        if not isinstance(json_or_none(args), dict):
            raise RequestError(f"{where}[{j}].function.arguments must be a JSON object's text",
                               param=f"{where}[{j}].function.arguments")
        cid = c.get("id")
        out.append(ToolCall(cid if isinstance(cid, str) else f"call_{j}", name, args))
    return tuple(out)


def _tools(v: Any) -> tuple[Tool, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    out = []
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(
                t.get("function"), dict):
            raise RequestError(f"{where} must be {{type: function, function: {{...}}}}",
                               param=where)
        fn = t["function"]
        name = _name(fn.get("name"), f"{where}.function.name")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise RequestError(f"'{where}.function.description' must be a string",
                               param=f"{where}.function.description")
        params = _schema(fn, "parameters", {"type": "object", "properties": {}},
                         f"{where}.function")
        out.append(Tool(name, desc, json.dumps(params)))
    if len({t.name for t in out}) != len(out):
        raise RequestError("tool names must be unique", param="tools")
    return tuple(out)


def _tool_choice(v: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if v is None:
        return ToolChoice(AUTO if tools else NONE)
    if v in (AUTO, NONE, REQUIRED):
        choice = ToolChoice(v)
    elif isinstance(v, dict) and v.get("type") == "function" and isinstance(
            v.get("function"), dict) and isinstance(v["function"].get("name"), str):
        choice = ToolChoice(FUNCTION, v["function"]["name"])
        if choice.name not in {t.name for t in tools}:
            raise RequestError(f"tool_choice names '{choice.name}', which is not in 'tools'",
                               param="tool_choice")
    else:
        raise RequestError("'tool_choice' must be 'auto', 'none', 'required' or "
                           "{type: function, function: {name}}", param="tool_choice")
    if choice.mode != NONE and not tools:
        raise RequestError(f"tool_choice '{choice.mode}' needs 'tools'", param="tool_choice")
    return choice


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise RequestError(f"'stop' must be a string or up to {MAX_STOP_SEQUENCES} non-empty "
                           f"strings of at most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(stops)


def parse_request(body: Any, *, chat: bool, limits: Limits) -> GenerationRequest:
    """Validate a decoded JSON body; raises RequestError (400) naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = _typed(body, "model", (str,), None)
    messages = prompt = None
    if chat:
        messages = _messages(body.get("messages"), limits)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string", param="prompt")
        if len(prompt) > limits.prompt_chars:
            raise RequestError(f"'prompt' is over {limits.prompt_chars} characters; this "
                               f"server's limit is {limits.prompt_chars} (its prompt limit is "
                               f"{limits.max_prompt_tokens} tokens)", param="prompt",
                               code="context_length_exceeded")
    n = _typed(body, "n", (int,), 1)
    if n != 1:
        raise RequestError("only n=1 is supported", param="n")
    tools = _tools(body.get("tools")) if chat else ()
    choice = _tool_choice(body.get("tool_choice"), tools) if chat else ToolChoice(NONE)
    for name in ("functions", "function_call", "echo", "best_of", "suffix",
                 *(() if chat else ("tools", "tool_choice"))):
        if body.get(name) not in (None, False, 0, 1) or (
                name in ("tools", "functions", "function_call", "tool_choice")
                and body.get(name)):
            raise RequestError(f"'{name}' is not supported", param=name)
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _bounded(body, mt_name, (int,), 0, limits.max_tokens,
                          min(256, limits.max_tokens))
    temperature = float(_bounded(body, "temperature", (int, float), 0, 2, 1.0))
    top_p = float(_typed(body, "top_p", (int, float), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise RequestError("'top_p' must be in (0, 1]", param="top_p")
    seed = _bounded(body, "seed", (int,), 0, MAX_SEED, None)
    stream = _typed(body, "stream", (bool,), False)
    opts = _typed(body, "stream_options", (dict,), {})
    include_usage = bool(opts.get("include_usage", False))
    # completions: `logprobs` an integer, the alternatives per token
    logprobs = (_chat_logprobs(body) if chat else
                _bounded(body, "logprobs", (int,), 0, MAX_TOP_LOGPROBS, None))
    grammar = response_format(body.get("response_format"))
    parallel = _typed(body, "parallel_tool_calls", (bool,), True)
    _check_tool_grammar(tools, choice, grammar, parallel)
    return GenerationRequest(model=model, messages=messages, prompt=prompt,
                             max_tokens=max_tokens, params=SamplingParams(temperature, top_p, seed),
                             stop=_stop(body.get("stop")), stream=stream,
                             include_usage=include_usage, logprobs=logprobs, tools=tools,
                             tool_choice=choice, grammar=grammar, parallel_tool_calls=parallel)


def _check_tool_grammar(tools: tuple[Tool, ...], choice: ToolChoice, grammar: Grammar | None,
                        parallel: bool) -> None:
    """A 400 naming the field for a tool_choice the grammar (`tools.tool_grammar`) cannot
    enforce, or a function's `parameters` llguidance cannot compile (the family's own grammar
    is built once the template is known: app.py)."""
    try:
        if tool_grammar(HERMES, tools, choice, grammar, parallel) is None:
            return
    except ToolGrammarError as e:
        raise RequestError(str(e), param=e.param) from None
    for i, t in enumerate(tools):
        if choice.mode == FUNCTION and t.name != choice.name:
            continue
        err = grammar_error(Grammar(JSON_SCHEMA, schema_text(call_schema(t.name, t.parameters))))
        if err is not None:
            field = f"tools[{i}].function.parameters"
            raise RequestError(f"'{field}' cannot be enforced (tool_choice "
                               f"'{choice.mode}'): {err.strip()[:500]}", param=field)


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs` a boolean, `top_logprobs` 0..20 (only with logprobs true)."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise RequestError(f"'logprobs' must be a boolean, got {type(on).__name__}",
                           param="logprobs")
    top = _bounded(body, "top_logprobs", (int,), 0, MAX_TOP_LOGPROBS, None)
    if top is not None and not on:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if on else None


MAX_GRAMMAR_CHARS = 64_000


def response_format(v: Any) -> Grammar | None:
    """`response_format`: `{type: text}` (None), `{type: json_object}`, `{type: json_schema,
    json_schema: {name, schema, strict?, description?}}`, and macfleet's extensions
    `{type: regex, regex: "..."}` and `{type: grammar, grammar: "<Lark>"}` (llguidance's Lark
    dialect). The grammar is compiled here, so a bad one is a 400 naming its field."""
    if v is None:
        return None
    where = "response_format"
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise RequestError(f"'{where}' must be an object with a 'type'", param=where)
    kind = v["type"]
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return Grammar(JSON_OBJECT)
    if kind == JSON_SCHEMA:
        js = v.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError(f"'{where}.json_schema' must be an object {{name, schema}}",
                               param=f"{where}.json_schema")
        _name(js.get("name"), f"{where}.json_schema.name")
        field = f"{where}.json_schema.schema"
        grammar = Grammar(JSON_SCHEMA, schema_text(
            _schema(js, "schema", {"type": "object"}, f"{where}.json_schema")))
    elif kind in (REGEX, LARK):
        src = v.get(kind)
        field = f"{where}.{kind}"
        if not isinstance(src, str) or not src or len(src) > MAX_GRAMMAR_CHARS:
            raise RequestError(f"'{field}' must be a non-empty string of at most "
                               f"{MAX_GRAMMAR_CHARS} characters", param=field)
        grammar = Grammar(kind, src)
    else:
        raise RequestError(f"'{where}.type' must be one of text, json_object, json_schema, "
                           f"regex, grammar; got '{kind}'", param=f"{where}.type")
    if len(grammar.source) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"'{field}' is over {MAX_GRAMMAR_CHARS} characters", param=field)
    err = grammar_error(grammar)
    if err is not None:
        raise RequestError(f"'{field}' cannot be compiled or run: {err.strip()[:500]}",
                           param=field)
    return grammar
