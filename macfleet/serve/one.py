"""One request through the serving engine on the caller's thread: `generate --local`.

The serving engine is the one decode path (issue 49): a request alone is a batch of one, so
`generate --local` decodes as `serve --local` decodes the same request (its drafters, its
`auto` choice, its grammar, its seeded draws), and what is measured or fixed in one is so in
the other. No engine thread: each `step` runs on the caller's thread and the request's events
are handed on as the step emits them, with the text of each commit (engine/text.py
`with_text`, as the single-session loops' driver does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from macfleet.engine.constraint import Grammar
from macfleet.engine.controller import AUTO, DraftTokens
from macfleet.engine.conversation import ChatInput
from macfleet.engine.events import Event, Finished
from macfleet.engine.models import LoadedModel
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.text import (DEFAULT_MAX_TOKENS, TextDelta, TextStream, encode_prompt,
                                  generate_local, with_text)
# what the engine checks itself (engine/batch.py check_batchable)
from macfleet.engine.tree_verify import supports_tree_attention as batchable
from macfleet.serve.batch_session import EngineEvent, EngineRequest, SessionFailed
from macfleet.serve.drafting import make_drafting
from macfleet.serve.engine import BatchEngine


class GenerationFailed(RuntimeError):
    """The engine ended the request without an answer (its message says why)."""


def generate_one(lm: LoadedModel, prompt: ChatInput, *, chat: bool = True,
                 proposer: str = "ngram", draft_tokens: DraftTokens = AUTO,
                 max_tokens: int = DEFAULT_MAX_TOKENS, params: SamplingParams = GREEDY,
                 grammar: Grammar | None = None) -> Iterator[TextDelta | Event]:
    """TextDelta for each commit, BlockDone per block, then Finished (as
    engine/text.py `generate_local`). prompt: a text, or a conversation ending on a user turn.
    A bad prompt, grammar or drafter spec raises ValueError before anything runs. A model the
    engine cannot batch (not llama-style attention: engine/batch.py) runs the single-session
    loops instead."""
    if not batchable(lm.model):
        yield from generate_local(lm, prompt, chat=chat, proposer=proposer,
                                  draft_tokens=draft_tokens, max_tokens=max_tokens,
                                  params=params, grammar=grammar)
        return
    ids = encode_prompt(lm.tokenizer, prompt, chat)
    # the request's drafter built once, here (an engine built on the spec builds one to check
    # it, then one per session: twice the drafters' loading for one request)
    drafting = make_drafting(proposer, lm, draft_tokens, invariant=False)
    try:
        engine = BatchEngine(lm, proposer="none", max_active=1, max_queue=1)
        emitted: deque[EngineEvent] = deque()
        handle = engine.submit(EngineRequest(tuple(ids), params, max_tokens,
                                             eos_ids=frozenset(lm.eos_ids),
                                             draft_tokens=draft_tokens, report_blocks=True,
                                             grammar=grammar), emitted.append,
                               proposer=drafting)
    except BaseException:
        if drafting is not None:
            drafting.close()
        raise
    try:
        yield from with_text(_events(engine, emitted), TextStream(lm.tokenizer))
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
