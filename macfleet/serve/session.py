"""One request's life on the server side: prompt ids in, text pieces out, session freed.
The engine thread's events reach the request's task through a queue; its own detokenizer turns
ids into text, text that could start a stop sequence is held back, and the engine session is
cancelled whenever the consumer stops early, so its KV is freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from macfleet.engine.constraint import GrammarError
from macfleet.engine.events import Finished, TokensCommitted
from macfleet.engine.text import TextStream
from macfleet.serve.engine import (EngineEvent, EngineRequest, Overloaded, SessionFailed,
                                   SessionHandle)
from macfleet.serve.logprobs import LogprobsCommitted, TokenLogprob
from macfleet.serve.prompt_cache import PromptReused

log = logging.getLogger(__name__)

DEFAULT_TOKEN_TIMEOUT_S = 120.0
DISCONNECT_POLL_S = 0.25  # how often a session read whole asks whether its client left


class GenerationFailed(RuntimeError):
    """The engine could not finish the request."""


@dataclass(frozen=True)
class Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens since the last piece (if asked)


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # stop | length
    completion_tokens: int
    drafted: int
    accepted: int
    cached_tokens: int = 0  # prompt tokens not prefilled (prompt cache, shared prefixes)
    blocks: int = 0  # verifier steps (verify blocks) this answer took
    prediction_accepted: int = 0  # the request's prediction's tokens accepted
    prediction_rejected: int = 0  # ... and verified, not accepted


class StopMatcher:
    """Emit text up to the first stop sequence; hold back a tail that may still become one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._buf += text
        hits = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._buf = self._buf[:min(hits)], ""
            return out
        cut = max(0, len(self._buf) - self._hold)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


class TooManySessions(Exception):
    """The client already holds its cap of open sessions."""


class ClientSessions:
    """Sessions open per client (at most `cap` each); a session's slot is held until the
    engine drops it, not until its response ends (a cancelled one still holds the engine)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: Counter[str] = Counter()

    def acquire(self, client: str) -> None:
        if self.open[client] >= self.cap:
            raise TooManySessions(f"{self.open[client]} sessions already open for this client")
        self.open[client] += 1

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]


def open_session(engine, req: EngineRequest, clients: ClientSessions | None = None,
                 client: str = "") -> tuple[SessionHandle, asyncio.Queue]:
    """Submit to the engine now (so TooManySessions, Overloaded and a GrammarError are raised
    before any response starts), holding one of `client`'s slots until the engine drops it."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[EngineEvent] = asyncio.Queue()

    def post(fn, *a) -> None:  # engine thread
        try:
            loop.call_soon_threadsafe(fn, *a)
        except RuntimeError:  # the server's loop is closed (shutdown): nobody to tell
            pass

    def emit(ev: EngineEvent) -> None:
        post(q.put_nowait, ev)

    def closed() -> None:
        if clients is not None:
            post(clients.release, client)

    if clients is not None:
        clients.acquire(client)
    try:
        return engine.submit(req, emit, closed), q
    except (Overloaded, GrammarError):  # refused: the engine never holds it
        if clients is not None:
            clients.release(client)
        raise


class _Events:
    """A session's engine events, each within `timeout_s`; None once the client left (`gone`,
    asked at least every DISCONNECT_POLL_S, also while events keep coming)."""

    def __init__(self, q: asyncio.Queue, timeout_s: float,
                 gone: Callable[[], Awaitable[bool]] | None) -> None:
        self.q, self.timeout_s, self.gone = q, timeout_s, gone
        self.check_at = time.monotonic() + DISCONNECT_POLL_S

    async def next(self) -> EngineEvent | None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            now = time.monotonic()
            if self.gone is not None and now >= self.check_at:
                self.check_at = now + DISCONNECT_POLL_S
                if await self.gone():
                    log.debug("client left before its answer was complete")
                    return None
            left = deadline - now
            if left <= 0:
                raise GenerationFailed(f"no token for {self.timeout_s:.0f} s")
            try:
                return await asyncio.wait_for(self.q.get(), left if self.gone is None
                                              else min(left, self.check_at - now))
            except TimeoutError:
                continue


async def run_session(handle: SessionHandle, q: asyncio.Queue, tokenizer, stops: Sequence[str],
                      *, outcome: list[Outcome],
                      token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S,
                      gone: Callable[[], Awaitable[bool]] | None = None
                      ) -> AsyncIterator[Piece]:
    """Yield text pieces; append the Outcome when the generation ended (not when cancelled).
    gone: whether the client left (for a whole answer: its server cancels a stream itself)."""
    text = TextStream(tokenizer)
    stop = StopMatcher(stops)
    events = _Events(q, token_timeout_s, gone)
    n = 0
    lps: tuple[TokenLogprob, ...] = ()  # not yet sent: their text is held back
    cached = 0
    try:
        while True:
            ev = await events.next()
            if ev is None:
                return
            if isinstance(ev, SessionFailed):
                raise GenerationFailed(ev.message)
            if isinstance(ev, PromptReused):
                cached = ev.tokens
            elif isinstance(ev, LogprobsCommitted):
                lps += ev.entries
            elif isinstance(ev, TokensCommitted):
                n += len(ev.tokens)
                out = stop.feed(text.add(ev.tokens))
                if out or stop.stopped:
                    yield Piece(out, lps)
                    lps = ()
                if stop.stopped:
                    outcome.append(Outcome("stop", n, 0, 0, cached))
                    return
            elif isinstance(ev, Finished):
                tail = stop.feed(text.finish())
                tail += stop.flush()
                if tail or lps:
                    yield Piece(tail, lps)
                st = ev.stats
                reason = "stop" if stop.stopped or st.finish_reason == "stop" else "length"
                outcome.append(Outcome(reason, st.tokens, st.drafted, st.accepted, cached,
                                       st.blocks, *st.prediction_tokens))
                return
    finally:
        handle.cancel()  # client gone, stop sequence or error: free the KV cache now (no-op
        # for a session the engine already finished)
