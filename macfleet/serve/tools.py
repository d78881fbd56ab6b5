"""Tool calls: the model's own tool-call text <-> OpenAI `tool_calls` (pure; no I/O, no MLX).

The request's `tools` are rendered by the model's chat template, and what the model writes back
is parsed in its family's format (hermes, llama3, mistral: `detect_format`); the format's markup
never reaches `content`. `tool_choice` "required" or a named function is enforced by a grammar
(`tool_grammar`). docs/serving.md, "tools.py".
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from macfleet.engine.constraint import (JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, Grammar,
                                        json_grammar_schema)

log = logging.getLogger(__name__)

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
AUTO, NONE, REQUIRED, FUNCTION = "auto", "none", "required", "function"

_H_OPEN, _H_CLOSE = "<tool_call>", "</tool_call>"
_PY_TAG = "<|python_tag|>"
_M_OPEN, _M_ARGS = "[TOOL_CALLS]", "[ARGS]"
NL = "\n"
_MARKERS = {HERMES: (_H_OPEN, _H_CLOSE), MISTRAL: (_M_OPEN,)}  # a call's markup, by format


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_dict(self, index: int | None = None) -> dict:
        """The API's shape (with `index` in a streamed delta)."""
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # auto | none | required | function
    name: str | None = None  # the function, for mode "function"


def detect_format(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model; None: no tool support."""
    if not template:
        return None
    if _M_OPEN in template:
        return MISTRAL
    if _H_OPEN in template:
        return HERMES
    if _PY_TAG in template or ("tools" in template and "ipython" in template):
        return LLAMA3
    return None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(obj, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = json_or_none(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(text: str, args_key: str = "arguments") -> list[ToolCall] | None:
    """A JSON object or list of objects -> calls; None when it is not that."""
    obj = json_or_none(text)
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(o, args_key) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls


def _leading_calls(text: str) -> list[ToolCall]:
    """The complete call objects at the start of a JSON list cut short (`[{..}, {..}, {..`)."""
    dec, calls, i = json.JSONDecoder(), [], 1
    while True:
        while i < len(text) and text[i] in " \n\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return calls
        c = _call(obj)
        if c is None:
            return calls
        calls.append(c)


def _cut_marker(text: str, markers: Sequence[str]) -> str:
    """`text` without an end that is the start of one of `markers` (a marker cut short)."""
    keep = max(_partial_suffix(text, m) for m in markers)
    return text[:len(text) - keep]


_H_BLOCK = re.compile(re.escape(_H_OPEN) + r"(.*?)(" + re.escape(_H_CLOSE) + r"|\Z)", re.S)


def _hermes(text: str, cut: bool) -> tuple[str, list[ToolCall]]:
    content, calls, pos = [], [], 0
    for m in _H_BLOCK.finditer(text):
        content.append(text[pos:m.start()])
        pos = m.end()
        if cut and not m.group(2):
            continue  # the call being written when the tokens ran out: not a call
        got = _calls(m.group(1).strip())
        if got is None:
            log.debug("a tool call that does not parse, left out: %.200r", m.group(0))
            continue
        calls.extend(got)
    content.append(text[pos:])
    out = "".join(content).replace(_H_CLOSE, "")  # a closing tag without its opening one
    if cut:
        out = _cut_marker(out, _MARKERS[HERMES])
    return (out.strip(), calls) if pos else (out, calls)


def _looks_like_call(body: str, cut: bool) -> bool:
    """Llama 3: an answer that starts as a call object does (`{"name":`), or, cut short, could."""
    if re.match(r'\{\s*"name"\s*:', body):
        return True
    return cut and bool(body) and _LLAMA3_HEAD.startswith(re.sub(r"\s+", "", body))


_LLAMA3_HEAD = '{"name":'


def _llama3(text: str, cut: bool) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    tagged = body.startswith(_PY_TAG)
    body = body[len(_PY_TAG):].strip() if tagged else body
    if not tagged and not body.startswith("{"):
        return ("", []) if cut and body and _PY_TAG.startswith(body) else (text, [])
    calls = _calls(body, "parameters")
    if calls is None:  # several calls joined by ';', the last one maybe cut short
        parts = [_calls(p.strip(), "parameters") for p in body.split(";") if p.strip()]
        if cut and parts and parts[-1] is None:
            parts.pop()
        calls = ([c for p in parts for c in p] if parts and all(p is not None for p in parts)
                 else None)
    if calls is not None:
        return "", calls
    if tagged or _looks_like_call(body, cut):
        log.debug("a tool call that does not parse, left out: %.200r", text)
        return "", []
    return text, []


def _mistral(text: str, cut: bool) -> tuple[str, list[ToolCall]]:
    i = text.find(_M_OPEN)
    if i < 0:
        return (_cut_marker(text, _MARKERS[MISTRAL]) if cut else text), []
    rest = text[i + len(_M_OPEN):].strip()
    calls = _calls(rest)
    if calls is None and _M_ARGS in rest:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        calls = []
        parts = rest.split(_M_OPEN)
        for k, part in enumerate(parts):
            name, _, args = part.partition(_M_ARGS)
            c = _call({"name": name.strip(), "arguments": json_or_none(args.strip())})
            if c is None:
                calls = calls if cut and k == len(parts) - 1 else []
                break
            calls.append(c)
    elif calls is None and cut and rest.startswith("["):
        calls = _leading_calls(rest)  # the list's complete calls before the cut
    if not calls:
        log.debug("a tool call that does not parse, left out: %.200r", text[i:])
    return text[:i].strip(), calls or []


def json_or_none(s: str):
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return None


_PARSERS = {HERMES: _hermes, LLAMA3: _llama3, MISTRAL: _mistral}


def parse_tool_calls(fmt: str, text: str, cut: bool = False) -> tuple[str, tuple[ToolCall, ...]]:
    """A whole answer -> (content, tool calls); a call that does not parse is left out
    (logged), and with `cut` (out of tokens) so are the call and a marker cut short."""
    content, calls = _PARSERS[fmt](text, cut)
    return content, tuple(calls)


def finish_reason(engine_reason: str, calls: bool) -> str:
    """The answer's finish_reason: `length` whenever the tokens ran out (even after complete
    calls: the answer was cut), else `tool_calls` when it holds calls."""
    if engine_reason == "length":
        return "length"
    return "tool_calls" if calls else engine_reason


class ToolStream:
    """Streaming: content out as soon as it cannot be part of a call, each call once complete
    (hermes: at its closing tag; llama3 and mistral: at the answer's end)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._buf = ""
        self._in_call = False
        self._decided = fmt != LLAMA3  # llama3: a call only when the answer starts with one
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out, new = [], []
        while True:
            if not self._in_call:
                self._scan_content(out)
                if not self._in_call:
                    break
            if self.fmt != HERMES:
                break  # the call runs to the end of the answer
            j = self._buf.find(_H_CLOSE)
            if j < 0:
                break
            block, self._buf = self._buf[:j + len(_H_CLOSE)], self._buf[j + len(_H_CLOSE):]
            self._in_call = False
            _, calls = _hermes(block, False)
            new.extend(calls)
        self.calls.extend(new)
        return "".join(out), new

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The rest, at the answer's end; `cut`: it ran out of tokens (parse_tool_calls)."""
        buf, self._buf = self._buf, ""
        if not self._in_call and self._decided:
            return (_cut_marker(buf, _MARKERS[self.fmt]) if cut and self.fmt != LLAMA3
                    else buf), []
        content, calls = parse_tool_calls(self.fmt, buf, cut)
        self.calls.extend(calls)
        return content, list(calls)

    def _scan_content(self, out: list[str]) -> None:
        """Move content out of the buffer up to a call's start (then in a call), holding back a
        tail that could still become a marker; a stray closing tag is dropped."""
        if not self._decided:  # llama3: the first characters decide
            head = self._buf.lstrip()
            if not head or _PY_TAG.startswith(head):  # nothing yet, or the tag being written
                return
            self._decided = True
            self._in_call = head.startswith("{") or head.startswith(_PY_TAG)
            if self._in_call:
                return
        if self.fmt == LLAMA3:
            out.append(self._buf)
            self._buf = ""
            return
        markers = _MARKERS[self.fmt]
        while True:
            hits = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
            if not hits:
                break
            i, m = min(hits)
            out.append(self._buf[:i])
            if m == _H_CLOSE:  # a closing tag without its opening one: markup, dropped
                self._buf = self._buf[i + len(m):]
                continue
            self._buf = self._buf[i:]
            self._in_call = True
            return
        keep = max(_partial_suffix(self._buf, m) for m in markers)
        out.append(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]


def _partial_suffix(s: str, marker: str) -> int:
    """The length of the longest end of `s` that is a proper start of `marker`."""
    for n in range(min(len(s), len(marker) - 1), 0, -1):
        if marker.startswith(s[-n:]):
            return n
    return 0


# -- enforced tool calls: the grammar of a family's tool-call text --------------------------
class ToolSpec(Protocol):
    name: str
    parameters: str  # the function's parameters, a JSON schema's text


class ToolGrammarError(ValueError):
    """A combination the grammar cannot express; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# the call objects' JSON as the templates write it (`tojson`): ", " and ": ", no other
# whitespace, so the keys and punctuation are forced tokens
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DEFS = ("$defs", "definitions")
ANSWER_KINDS = (JSON_OBJECT, JSON_SCHEMA, REGEX)  # response_format kinds "auto" can embed


def call_schema(name: str, parameters: str, args_key: str = "arguments") -> dict:
    """The JSON schema of one call object `{"name": NAME, args_key: ARGS}`, ARGS valid against
    `parameters`. Its `$defs`/`definitions` move to the top (where `#/$defs/..` refs point)
    and its `x-guidance` options apply to the whole call."""
    params = json.loads(parameters)
    params = dict(params) if isinstance(params, dict) else {}
    lifted = {k: params.pop(k) for k in _DEFS if k in params}
    options = {**CALL_JSON_OPTIONS, **(params.pop("x-guidance", None) or {})}
    return {"type": "object", "properties": {"name": {"const": name}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False,
            "x-guidance": options, **lifted}


def _answer_rule(answer: Grammar) -> str:
    """A response_format as one Lark rule's body."""
    from llguidance import regex_to_lark

    if answer.kind in (JSON_OBJECT, JSON_SCHEMA):
        return "%json " + json_grammar_schema(answer)
    if answer.kind == REGEX:
        return "/" + regex_to_lark(answer.source, "") + "/"
    raise ToolGrammarError(f"a response_format of type '{answer.kind}' cannot be combined with "
                           f"tools (one of {', '.join(ANSWER_KINDS)} can)", "response_format")


def tool_grammar(fmt: str, tools: Sequence[ToolSpec], choice: ToolChoice,
                 answer: Grammar | None = None, parallel: bool = True) -> Grammar | None:
    """The grammar that enforces `choice` in format `fmt` (None: nothing to enforce, the
    template asks and the parser reads). required: one call to any of `tools` or several
    (`parallel`); function: one call to that one; auto with `answer` (a response_format):
    an answer matching it or calls, as required."""
    if choice.mode == NONE or (choice.mode == AUTO and answer is None):
        return None
    if answer is not None and choice.mode != AUTO:
        raise ToolGrammarError(f"'response_format' cannot be combined with tool_choice "
                               f"'{choice.mode}' (the answer is a tool call); send "
                               "tool_choice 'auto' for an answer or a call",
                               "response_format")
    pick = [t for t in tools if choice.mode != FUNCTION or t.name == choice.name]
    if not pick:
        raise ToolGrammarError(f"tool_choice names '{choice.name}', which is not in 'tools'",
                               "tool_choice")
    key = "parameters" if fmt == LLAMA3 else "arguments"
    many = parallel and choice.mode != FUNCTION
    q = json.dumps  # a Lark string literal
    call = f"{q(_H_OPEN + NL)} fn {q(NL + _H_CLOSE)}" if fmt == HERMES else "fn"
    sep = q({HERMES: NL, LLAMA3: "; ", MISTRAL: ", "}[fmt])
    calls = f"call ({sep} call)*" if many else "call"
    if fmt == MISTRAL:
        calls = f'{q(_M_OPEN + "[")} {calls} {q("]")}'
    lines = ["start: " + ("answer | calls" if answer is not None else "calls"),
             "calls: " + calls, "call: " + call,
             "fn: " + " | ".join(f"fn_{i}" for i in range(len(pick)))]
    lines += [f"fn_{i}: %json {q(call_schema(t.name, t.parameters, key))}"
              for i, t in enumerate(pick)]
    if answer is not None:
        lines.append("answer: " + _answer_rule(answer))
    return Grammar(LARK, NL.join(lines) + NL)
