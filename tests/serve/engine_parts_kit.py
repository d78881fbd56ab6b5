"""Sessions and fakes for the serving engine's parts' own tests (no model unless named)."""

from __future__ import annotations

from collections.abc import Sequence

from macfleet.engine.controller import make_controller
from macfleet.engine.proposers.base import Draft, Proposer, ProposerFailed
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.serve.batch_session import (BatchSession, BlockDraft, EngineRequest, KVHandle,
                                          SessionStats)
from macfleet.serve.timing import TokenTimes


def session(sid: int = 0, prompt: Sequence[int] = (1, 2, 3), max_tokens: int = 8, *,
            params: SamplingParams = GREEDY, eos: frozenset[int] = frozenset(),
            proposer: Proposer | None = None, draft_tokens=0, **kw) -> BatchSession:
    """A session whose events go to its `.events` list."""
    events: list = []
    s = BatchSession(sid, EngineRequest(tuple(prompt), params, max_tokens, eos), events.append,
                     proposer, make_controller(draft_tokens), KVHandle(len(prompt) - 1),
                     BlockDraft(), SessionStats(TokenTimes(0.0)), **kw)
    s.events = events
    return s


class Scripted(Proposer):
    """Drafts what it is told; fails when told to."""

    name = "scripted"

    def __init__(self, drafts: Sequence[tuple[int, ...]] = (), fail: bool = False) -> None:
        self.drafts, self.fail, self.closed = list(drafts), fail, False
        self.seen: list[int] = []  # the k of each draft asked for
        self.observed: list[tuple[int, int]] = []  # (drafted, accepted) of each block

    def propose(self, context, k) -> Draft:
        if self.fail:
            raise ProposerFailed("gone")
        self.seen.append(k)
        return Draft(tuple(self.drafts.pop(0)) if self.drafts else ())

    def observe(self, drafted, accepted, verify_ms, verified=None) -> None:
        self.observed.append((drafted, accepted))

    def close(self) -> None:
        self.closed = True


def serve_collect(engine, reqs: Sequence[EngineRequest]) -> list[tuple[list[int], list, object]]:
    """Submit every request to a BatchEngine and run it until idle: per request, in request
    order, its committed tokens, its logprob entries (each batch of entries checked to arrive
    right before its tokens) and its Finished event."""
    from macfleet.engine.events import Finished, TokensCommitted
    from macfleet.serve.logprobs import LogprobsCommitted

    toks = {i: [] for i in range(len(reqs))}
    lps = {i: [] for i in range(len(reqs))}
    done = {}
    for i, r in enumerate(reqs):
        def emit(ev, i=i):
            if isinstance(ev, LogprobsCommitted):
                assert len(lps[i]) == len(toks[i])  # right before its tokens
                lps[i].extend(ev.entries)
            elif isinstance(ev, TokensCommitted):
                toks[i].extend(ev.tokens)
            elif isinstance(ev, Finished):
                done[i] = ev
        engine.submit(r, emit)
    engine.run_until_idle()
    return [(toks[i], lps[i], done[i]) for i in range(len(reqs))]


def serve_all(engine, reqs: Sequence[EngineRequest]) -> list[tuple[list[int], object]]:
    """`serve_collect` without the logprobs: per request its tokens and its Finished event."""
    return [(t, fin) for t, _, fin in serve_collect(engine, reqs)]
