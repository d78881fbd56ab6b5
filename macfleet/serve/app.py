"""The OpenAI-compatible HTTP API (Starlette): routes, limits, errors, server-sent events.

Every failure is an OpenAI-shaped error object `{"error": {message, type, param, code}}` with
the usual status: 400 bad JSON or parameters, 401 missing/wrong API key, 404 unknown route or
model, 413 oversize body, 429 too many sessions for one client, 503 no verifier or queue full.
Handlers catch what they can answer; anything else is logged and answered 500, and the server
keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from macfleet.engine.constraint import Grammar, GrammarError
from macfleet.fleet.batch import BATCH_PATH
from macfleet.serve.engine import EngineRequest, Overloaded
from macfleet.serve.intake import decode_body, partition
from macfleet.serve.logprobs import (TokenLogprob, TokenText, chat_content, completion_logprobs,
                                     token_text)
from macfleet.serve.prediction import parse_prediction, prediction_ids, usage_details
from macfleet.serve.prompt import Prompt, render_prompt
from macfleet.serve.schemas import GenerationRequest, Limits, RequestError, parse_request
from macfleet.serve.session import (ClientSessions, GenerationFailed, Outcome, Piece,
                                    TooManySessions, open_session, run_session)
from macfleet.serve.tools import (ToolCall, ToolGrammarError, ToolStream, finish_reason,
                                   parse_tool_calls, tool_grammar)

log = logging.getLogger(__name__)

PREPARE_THREADS = 2  # requests prepared at once, on worker threads (more wait their turn)


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    # the API keys a request may carry (none: no key); several: a cache partition each
    api_keys: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    chat_template: str | None = None  # replaces the model's own (serve --chat-template)


@dataclass(frozen=True)
class _Prepared:
    """A request decoded, validated and rendered (on a worker thread)."""

    req: GenerationRequest
    prompt: Prompt
    grammar: Grammar | None
    where: str
    prediction: tuple[int, ...] = ()  # the `prediction` field's token ids (Predicted Outputs)


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Api:
    """Holds the engine, tokenizer and per-client session counts behind the routes."""

    def __init__(self, engine, tokenizer, config: ServerConfig) -> None:
        self.engine, self.tok, self.cfg = engine, tokenizer, config
        self.clients = ClientSessions(config.limits.max_sessions_per_client)
        self.created = int(time.time())
        self.token_text = token_text(tokenizer)  # a token's text alone, for logprobs
        self._prepare_slots: anyio.CapacityLimiter | None = None  # made on the loop

    # -- checks ---------------------------------------------------------------------------
    def _auth(self, request: Request) -> str:
        """The request's cache partition (`partition`); 401 without one of the keys."""
        if not self.cfg.api_keys:
            return ""
        got = request.headers.get("authorization", "")
        token = got[7:] if got.lower().startswith("bearer ") else ""
        ok = False
        for key in self.cfg.api_keys:  # every key compared: the time says not which matched
            ok |= hmac.compare_digest(token.encode(), key.encode())
        if not ok:
            raise RequestError("missing or wrong API key (Authorization: Bearer KEY)",
                               status=401, code="invalid_api_key")
        return partition(self.cfg.api_keys, token)

    async def _body(self, request: Request) -> bytes:
        limit = self.cfg.limits.max_body_bytes
        too_large = RequestError(f"request body over {limit} bytes", status=413,
                                 code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise too_large
        return bytes(buf)

    def _prepare(self, buf: bytes, chat: bool) -> _Prepared:
        """Decode, validate, render and tokenise a request, and check its grammar (a worker
        thread's work: a large body or a long chat would hold the event loop)."""
        body = decode_body(buf)
        req = parse_request(body, chat=chat, limits=self.cfg.limits)
        predicted = parse_prediction(body)
        if req.model is not None and req.model != self.cfg.model_id:
            raise RequestError(f"model '{req.model}' is not served here; this server serves "
                               f"'{self.cfg.model_id}' (GET /v1/models)", param="model",
                               status=404, code="model_not_found")
        if not self.engine.alive:
            raise RequestError("no verifier is available", status=503, kind="server_error",
                               code="unavailable")
        if predicted and not getattr(self.engine, "supports_prediction", False):
            raise RequestError("'prediction' drafts a token tree, which this server's "
                               "batch-invariant mode does not verify", param="prediction")
        prompt = render_prompt(self.tok, req, self.cfg.limits, self.cfg.chat_template)
        grammar, where = _grammar(req, prompt)
        if grammar is not None:
            self._check_grammar(grammar, where)
        return _Prepared(req, prompt, grammar, where,
                         prediction_ids(self.tok, predicted, self.cfg.limits))

    async def _prepared(self, request: Request, chat: bool) -> _Prepared:
        buf = await self._body(request)
        if self._prepare_slots is None:
            self._prepare_slots = anyio.CapacityLimiter(PREPARE_THREADS)
        return await anyio.to_thread.run_sync(self._prepare, buf, chat,
                                              limiter=self._prepare_slots)

    # -- routes ---------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        alive = self.engine.alive
        active, waiting = self.engine.load()
        recent = self.engine.recent(32)
        body = {"status": "ok" if alive else "unavailable", "model": self.cfg.model_id,
                "active_sessions": active, "waiting_sessions": waiting,
                "iterations": self.engine.iterations,
                "recent_iterations": [
                    {"sessions": r.sessions, "decode_tokens": r.decode_tokens,
                     "prefill_tokens": r.prefill_tokens, "queued": r.queued,
                     "ms": round(r.ms, 2)} for r in recent],
                "sessions": [si.to_dict() for si in self.engine.sessions()]}
        return JSONResponse(body, status_code=200 if alive else 503)

    async def batch(self, request: Request) -> Response:
        """The continuous batch for the dashboard (`BatchView`, fleet/batch.py); 200 even
        without a verifier (the view says so), the API key when one is set."""
        self._auth(request)
        # off the event loop: a fleet engine asks its verifier agent over the network
        view = await asyncio.to_thread(self.engine.batch_view, self.cfg.model_id)
        return JSONResponse(view.to_dict())

    async def models(self, request: Request) -> Response:
        self._auth(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.cfg.model_id, "object": "model", "created": self.created,
             "owned_by": "macfleet"}]})

    async def generate(self, request: Request, *, chat: bool) -> Response:
        """POST /v1/chat/completions (`chat`) or /v1/completions."""
        part = self._auth(request)
        prep = await self._prepared(request, chat)
        req, prompt, grammar, where = prep.req, prep.prompt, prep.grammar, prep.where
        eos = frozenset(getattr(self.tok, "eos_token_ids", ()) or ())
        ereq = EngineRequest(tuple(prompt.ids), req.params, req.max_tokens, eos, prompt.text,
                             logprobs=req.logprobs, grammar=grammar, partition=part,
                             prediction=prep.prediction)
        meta = _Meta(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                     int(time.time()), self.cfg.model_id, chat, len(prompt.ids), req.logprobs,
                     self.token_text, prompt, req.include_usage)
        try:
            handle, q = open_session(self.engine, ereq, self.clients,
                                     request.client.host if request.client else "?")
        except TooManySessions as e:
            raise RequestError(str(e), status=429, kind="rate_limit_error",
                               code="too_many_sessions") from None
        except Overloaded as e:
            raise RequestError(f"server busy: {e}", status=503, kind="server_error",
                               code="overloaded") from None
        except GrammarError as e:  # compiled with the model's tokenizer: refused there
            raise RequestError(f"'{where}' cannot be followed: {e}", param=where) from None
        outcome: list[Outcome] = []
        # a stream is cancelled by the server when its client leaves; a whole answer is not
        pieces = run_session(handle, q, self.tok, req.stop, outcome=outcome,
                             gone=None if req.stream else request.is_disconnected)
        if req.stream:
            return StreamingResponse(self._sse(pieces, meta, outcome),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            got = [p async for p in pieces]
        except GenerationFailed as e:
            raise RequestError(str(e), status=500, kind="server_error") from None
        finally:
            handle.cancel()
        if not outcome:  # the client left; nobody reads this
            return Response(status_code=499)
        text = "".join(p.text for p in got)
        lps = tuple(e for p in got for e in p.logprobs)
        calls: tuple[ToolCall, ...] = ()
        if meta.prompt.tool_format is not None:
            text, calls = parse_tool_calls(meta.prompt.tool_format, text,
                                           cut=outcome[0].finish_reason == "length")
        return JSONResponse(meta.full(text, outcome[0], lps, calls))

    def _check_grammar(self, grammar: Grammar, where: str) -> None:
        """A grammar (`where` names its field) compiled against this model and run a few
        tokens in, refused before admission (a worker thread's work: the grammar engine's
        tokenizer is built on first use, in seconds)."""
        err = self.engine.grammar_error(grammar)
        if err is not None:
            raise RequestError(f"'{where}' cannot be followed by this model: "
                               f"{err.strip()[:500]}", param=where)

    async def _sse(self, pieces: AsyncIterator[Piece], meta: _Meta,
                   outcome: list[Outcome]) -> AsyncIterator[str]:
        try:
            if meta.chat:
                yield _event(meta.chunk(None, {"role": "assistant", "content": ""}))
            sent = 0  # characters so far (a completion's logprobs text_offset)
            fmt = meta.prompt.tool_format
            tools = ToolStream(fmt) if fmt is not None else None
            async for p in pieces:
                text, calls = tools.feed(p.text) if tools is not None else (p.text, [])
                if text or p.logprobs:
                    yield _event(meta.chunk(None, text if not meta.chat
                                            else {"content": text},
                                            meta.logprobs(p.logprobs, sent)))
                    sent += len(text)
                for c in calls:
                    yield _event(meta.call_chunk(c, tools))
            o = outcome[0]
            if tools is not None:
                text, calls = tools.finish(cut=o.finish_reason == "length")
                if text:
                    yield _event(meta.chunk(None, {"content": text}))
                for c in calls:
                    yield _event(meta.call_chunk(c, tools))
            finish = finish_reason(o.finish_reason, tools is not None and bool(tools.calls))
            yield _event(meta.chunk(finish, "" if not meta.chat else {}))
            if meta.include_usage:
                yield _event({**meta.chunk(None, {}), "choices": [], "usage": meta.usage(o)})
        except GenerationFailed as e:  # the status line is gone: an error event, then [DONE]
            yield _event(RequestError(str(e), status=500, kind="server_error").body())
        finally:
            await pieces.aclose()
        yield "data: [DONE]\n\n"


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int
    top: int | None  # logprobs asked for (alternatives per token), or None
    token_text: TokenText
    prompt: Prompt
    include_usage: bool  # a stream's last chunk carries the usage

    def call_chunk(self, call: ToolCall, tools: ToolStream) -> dict:
        """A streamed tool call, whole (its name and all its arguments in one delta)."""
        return self.chunk(None, {"tool_calls": [call.to_dict(tools.calls.index(call))]})

    def logprobs(self, entries: tuple[TokenLogprob, ...], offset: int = 0) -> dict | None:
        """A choice's `logprobs` (chat or completion shape), None when not asked for."""
        if self.top is None:
            return None
        if self.chat:
            return {"content": chat_content(entries, self.token_text), "refusal": None}
        return completion_logprobs(entries, self.token_text, self.top, offset)

    def usage(self, o: Outcome) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": o.completion_tokens,
                "total_tokens": self.prompt_tokens + o.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
                **usage_details(o)}

    def full(self, text: str, o: Outcome, lps: tuple[TokenLogprob, ...] = (),
             calls: tuple[ToolCall, ...] = ()) -> dict:
        message = {"role": "assistant", "content": (text or None) if calls else text}
        if calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
        # a completion has no calls: its finish_reason is the engine's
        choice = {"index": 0, **({"message": message} if self.chat else {"text": text}),
                  "finish_reason": finish_reason(o.finish_reason, bool(calls)),
                  "logprobs": self.logprobs(lps)}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(o)}

    def chunk(self, finish: str | None, delta, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta" if self.chat else "text": delta, "finish_reason": finish,
                  "logprobs": logprobs}
        return {"id": self.id, "created": self.created, "model": self.model,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [choice]}


def _grammar(req: GenerationRequest, prompt: Prompt) -> tuple[Grammar | None, str]:
    """The grammar the answer must match and the field it comes from: the enforced tool calls
    in the template's format (tool_choice required or named, or auto beside a
    response_format), else the response_format."""
    if prompt.tool_format is None:
        return req.grammar, "response_format"
    try:
        g = tool_grammar(prompt.tool_format, req.tools, req.tool_choice, req.grammar,
                         req.parallel_tool_calls)
    except ToolGrammarError as e:  # parse_request checked it already, for any format
        raise RequestError(str(e), param=e.param) from None
    return (g, "tool_choice") if g is not None else (req.grammar, "response_format")


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _request_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return error_response(RequestError(str(getattr(exc, "detail", exc)), status=status,
                                       kind=kind))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(RequestError("internal server error", status=500,
                                       kind="server_error"))


def create_app(engine, tokenizer, config: ServerConfig) -> Starlette:
    api = Api(engine, tokenizer, config)
    routes = [Route("/health", api.health, methods=["GET"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route(BATCH_PATH, api.batch, methods=["GET"]),
              Route("/v1/chat/completions", partial(api.generate, chat=True), methods=["POST"]),
              Route("/v1/completions", partial(api.generate, chat=False), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={
        RequestError: _request_error, HTTPException: _http_error, Exception: _server_error})
