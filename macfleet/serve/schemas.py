"""OpenAI request bodies -> typed frozen requests, validated once at the edge.

Only what macfleet honours is accepted; a field with a wrong type or range is a 400 that names
the field (`param`), like OpenAI's own errors. Unknown fields are ignored (clients send many:
`user`, `logit_bias`, ...), except those that would change the answer silently (`n` > 1,
`functions`, `echo`, ...), which are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from macfleet.engine.sampling import MAX_SEED, SamplingParams
from macfleet.serve.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 64
ROLES = ("system", "user", "assistant", "tool", "developer")


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


@dataclass(frozen=True)
class Message:
    role: str
    content: str


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


def _content(v: Any, where: str) -> str:
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
    raise RequestError("message content must be a string or a list of text parts", param=where)


def _messages(v: Any) -> tuple[Message, ...]:
    if not isinstance(v, list) or not v:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}",
                               param=f"messages[{i}].role")
        out.append(Message(role, _content(m.get("content"), f"messages[{i}].content")))
    return tuple(out)


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
        messages = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string", param="prompt")
    n = _typed(body, "n", (int,), 1)
    if n != 1:
        raise RequestError("only n=1 is supported", param="n")
    for name in ("tools", "functions", "echo", "best_of", "suffix"):
        if body.get(name) not in (None, False, 0, 1) or (name in ("tools", "functions")
                                                          and body.get(name)):
            raise RequestError(f"'{name}' is not supported", param=name)
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _typed(body, mt_name, (int,), min(256, limits.max_tokens))
    if not 0 <= max_tokens <= limits.max_tokens:
        raise RequestError(f"'{mt_name}' must be 0..{limits.max_tokens}", param=mt_name)
    temperature = float(_typed(body, "temperature", (int, float), 1.0))
    top_p = float(_typed(body, "top_p", (int, float), 1.0))
    seed = _typed(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise RequestError(f"'seed' must be 0..{MAX_SEED}", param="seed")
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("'temperature' must be 0..2", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise RequestError("'top_p' must be in (0, 1]", param="top_p")
    stream = _typed(body, "stream", (bool,), False)
    opts = _typed(body, "stream_options", (dict,), {})
    include_usage = bool(opts.get("include_usage", False))
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    return GenerationRequest(model=model, messages=messages, prompt=prompt,
                             max_tokens=max_tokens, params=SamplingParams(temperature, top_p, seed),
                             stop=_stop(body.get("stop")), stream=stream,
                             include_usage=include_usage, logprobs=logprobs)


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs` a boolean, `top_logprobs` 0..20 (only with logprobs true)."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise RequestError(f"'logprobs' must be a boolean, got {type(on).__name__}",
                           param="logprobs")
    top = _typed(body, "top_logprobs", (int,), None)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be 0..{MAX_TOP_LOGPROBS}",
                           param="top_logprobs")
    if top is not None and not on:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if on else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions: `logprobs` an integer 0..20, the alternatives per token."""
    top = _typed(body, "logprobs", (int,), None)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'logprobs' must be 0..{MAX_TOP_LOGPROBS}", param="logprobs")
    return top
