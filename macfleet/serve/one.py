"""One request through the serving engine on the caller's thread (`generate --local`, the
verifier agent's one-session path, a sharded verifier's run): a request alone is a batch of
one, so it decodes as `serve --local` decodes it. No engine thread: each `step` runs on the
caller's thread and the events are handed on as it emits them (`run_one`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from macfleet.engine.constraint import Grammar
from macfleet.engine.controller import AUTO, DraftTokens
from macfleet.engine.conversation import ChatInput
from macfleet.engine.events import Event, Finished
from macfleet.engine.models import LoadedModel
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.text import (DEFAULT_MAX_TOKENS, Drafting, TextDelta, TextStream,
                                  encode_prompt, with_text)
from macfleet.engine.verifier import Verifier
from macfleet.serve.batch_session import EngineEvent, EngineRequest, SessionFailed
from macfleet.serve.drafting import make_drafting
from macfleet.serve.engine import BatchEngine


class GenerationFailed(RuntimeError):
    """The engine ended the request without an answer (its message says why)."""


def generate_one(lm: LoadedModel, prompt: ChatInput, *, chat: bool = True,
                 proposer: str = "ngram", draft_tokens: DraftTokens = AUTO,
                 max_tokens: int = DEFAULT_MAX_TOKENS, params: SamplingParams = GREEDY,
                 grammar: Grammar | None = None) -> Iterator[TextDelta | Event]:
    """TextDelta for each commit, BlockDone per block, the detokenizer's flush as a last
    TextDelta, then Finished. prompt: a text, or a conversation ending on a user turn. A bad
    prompt, grammar or drafter spec raises ValueError before anything runs."""
    ids = encode_prompt(lm.tokenizer, prompt, chat)
    engine = one_engine(lm)
    # the request's drafter built once, here (an engine on the spec would load it twice)
    drafting = make_drafting(proposer, lm, draft_tokens, engine.invariant)
    yield from with_text(decode_ids(lm, ids, drafting, draft_tokens=draft_tokens,
                                    max_tokens=max_tokens, params=params, grammar=grammar,
                                    engine=engine), TextStream(lm.tokenizer))


def decode_ids(lm: LoadedModel, ids: Sequence[int], drafting: Drafting = None, *,
               draft_tokens: DraftTokens = AUTO, max_tokens: int = DEFAULT_MAX_TOKENS,
               params: SamplingParams = GREEDY, eos_ids: frozenset[int] | None = None,
               grammar: Grammar | None = None, verifier: Verifier | None = None,
               engine: BatchEngine | None = None) -> Iterator[Event]:
    """Token ids in, the engine's events out (BlockDone per block, TokensCommitted, then
    Finished): one request on a fresh engine (`one_engine`, on `verifier` when given) or on
    `engine`. drafting: its drafter (a chain, a group, or None: plain decoding); eos_ids:
    the model's when None."""
    req = EngineRequest(tuple(ids), params, max_tokens,
                        eos_ids=frozenset(lm.eos_ids if eos_ids is None else eos_ids),
                        draft_tokens=draft_tokens, report_blocks=True, grammar=grammar)
    yield from run_one(engine or one_engine(lm, verifier), req, drafting)


def one_engine(lm: LoadedModel, verifier: Verifier | None = None) -> BatchEngine:
    """An engine for one request at a time, stepped by its caller (`run_one`); verifier: the
    one its sessions run through (a sharded verifier), else the model's own."""
    return BatchEngine(lm, proposer="none", max_active=1, max_queue=1, verifier=verifier)


def run_one(engine: BatchEngine, req: EngineRequest,
            drafting: Drafting = None, **submit) -> Iterator[Event]:
    """`req` through `engine` on the caller's thread: its events as each step emits them,
    ending with Finished; a failed session raises GenerationFailed. drafting: the request's
    drafter (closed with the session; here if the engine refuses the request); submit: the
    rest of `BatchEngine.submit`'s keywords (a shipped KV)."""
    emitted: deque[EngineEvent] = deque()
    try:
        handle = engine.submit(req, emitted.append, proposer=drafting, **submit)
    except BaseException:
        if drafting is not None:
            drafting.close()
        raise
    try:
        yield from _events(engine, emitted)
    finally:
        handle.cancel()  # a caller that stops reading frees the session (a no-op once ended)
        engine.run_until_idle()


def _events(engine: BatchEngine, emitted: deque[EngineEvent]) -> Iterator[Event]:
    while True:
        ran = engine.step()
        while emitted:
            ev = emitted.popleft()
            if isinstance(ev, SessionFailed):
                raise GenerationFailed(ev.message)
            yield ev
            if isinstance(ev, Finished):
                return
        if not ran:
            raise GenerationFailed("the engine ended the request without finishing it")
