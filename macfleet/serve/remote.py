"""Serving through a fleet's verifier agent: each request forwarded with `generate_remote`,
behind the same interface as `BatchEngine` (the agent batches; this keeps the client-side view
for the dashboard). docs/serving.md, "remote.py".
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bridge.errors import (BUSY, FORBIDDEN, INTERNAL, PeerUnavailable, ProtocolError,
                           TransportTimeout)
from bridge.messages import GenerateChunk, GenerateDone
from macfleet.engine.constraint import Grammar, grammar_error
from macfleet.engine.events import Finished, TokensCommitted
from macfleet.fleet.batch import BatchView, ServedSession
from macfleet.fleet.client import batch_status, generate_remote, probe, refused_endpoint
from macfleet.serve.engine import EngineEvent, EngineRequest, Overloaded, SessionFailed
from macfleet.serve.logprobs import LogprobsCommitted, TokenLogprob
from macfleet.serve.prompt_cache import PromptReused
from macfleet.serve.timing import RECENT_SESSIONS, TokenTimes

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 1.0  # the dashboard's poll must not hang on a busy agent
BUSY_RETRY_S = 0.25  # a full verifier queue: ask again this often ...
BUSY_WAIT_S = 600.0  # ... for at most this long (the HTTP client's own timeout may be shorter)
RECHECK_S = 2.0  # a verifier lost to a transport error is asked for its status this often


def chunk_logprobs(msg: GenerateChunk) -> tuple[TokenLogprob, ...]:
    """A chunk's logprobs as the serving layer's records; a chunk that lacks them (or whose
    lists do not match its tokens) is a protocol error, not silently empty logprobs."""
    n = len(msg.token_ids)
    if len(msg.logprobs) != n or len(msg.top) != n:
        raise ProtocolError(INTERNAL, f"a chunk of {n} tokens carried {len(msg.logprobs)} "
                                      f"logprobs and {len(msg.top)} alternatives")
    return tuple(TokenLogprob(int(t), float(lp), tuple((int(a), float(b)) for a, b in top))
                 for t, lp, top in zip(msg.token_ids, msg.logprobs, msg.top))


@dataclass
class _Handle:
    cancelled: bool = False
    sid: int = 0
    prompt_tokens: int = 0
    times: TokenTimes = field(default_factory=lambda: TokenTimes(time.perf_counter()))
    state: str = "queued"
    generated: int = 0
    drafted: int = 0
    accepted: int = 0

    def cancel(self) -> None:
        self.cancelled = True

    def view(self) -> ServedSession:
        t = self.times
        return ServedSession(sid=self.sid, state=self.state, prompt_tokens=self.prompt_tokens,
                             prefill_left=0, generated=self.generated, ttft_ms=t.ttft_ms,
                             itl_p50_ms=t.itl_ms(0.5), itl_p99_ms=t.itl_ms(0.99),
                             accepted=self.accepted, drafted=self.drafted)


class RemoteEngine:
    """Forwards every request to one verifier agent (chosen by `choose_roles`)."""

    supports_prediction = True  # the agent's batch drafts from it (protocol 5)

    def __init__(self, verifier, proposers, key: bytes | None, *, proposer: str = "ngram",
                 draft_tokens: int | str = "auto", max_active: int = 16,
                 max_queue: int = 64, clock: Callable[[], float] = time.monotonic,
                 status: Callable[..., object] = probe) -> None:
        """clock, status: when and how a lost verifier is asked again (tests replace them)."""
        self.verifier, self.proposers, self.key = verifier, proposers, key
        self.proposer_spec, self.draft_tokens = proposer, draft_tokens
        self.max_active, self.max_queue = max_active, max_queue
        self._slots = threading.BoundedSemaphore(max_active)
        self._lock = threading.Lock()
        self._active = self._waiting = 0
        self._stopped = False
        self._lost_at: float | None = None  # when a transport error lost the verifier agent
        self._asked_at = -math.inf
        self._asking = threading.Lock()
        self._clock, self._status = clock, status
        self._next = 0
        self._live: dict[int, _Handle] = {}
        self._ended: deque[ServedSession] = deque(maxlen=RECENT_SESSIONS)
        self.iterations = 0

    @property
    def alive(self) -> bool:
        """Whether requests can be forwarded. A verifier agent lost to a transport error is
        asked for its status again, at most every RECHECK_S, by the next request that looks:
        503s until it answers, then it serves again (it was maybe only slow once)."""
        if self._stopped:
            return False
        if self._lost_at is None:
            return True
        now = self._clock()
        if now - self._asked_at < RECHECK_S or not self._asking.acquire(blocking=False):
            return False
        try:
            self._asked_at = now
            if not self._status(self.verifier.card, self.key, pings=0,
                                timeout=STATUS_TIMEOUT_S).alive:
                return False
            log.warning("verifier agent %s answers again: serving", self.verifier.card.name)
            self._lost_at = None
            return True
        finally:
            self._asking.release()

    def start(self) -> RemoteEngine:
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped = True

    def recent(self, n: int = 32) -> list:
        """The verifier agent's last n iterations ([] when it cannot be read)."""
        st = batch_status(self.verifier.card, self.key, recent=n, timeout=STATUS_TIMEOUT_S)
        return list(st.recent) if st is not None else []

    def sessions(self) -> list[ServedSession]:
        """Live sessions (oldest first), then recently ended ones."""
        with self._lock:
            live, ended = sorted(self._live.values(), key=lambda h: h.sid), list(self._ended)
        return [h.view() for h in live] + ended[::-1]

    def batch_view(self, model: str, n: int = 32) -> BatchView:
        """The verifier agent's iterations; load and per-session latency as clients see them."""
        active, waiting = self.load()
        st = batch_status(self.verifier.card, self.key, recent=n, timeout=STATUS_TIMEOUT_S)
        return BatchView(model=model, mode="fleet", alive=self.alive, active=active,
                         waiting=waiting, iterations=st.iterations if st is not None else 0,
                         recent=st.recent if st is not None else (),
                         sessions=tuple(self.sessions()))

    def grammar_error(self, grammar: Grammar) -> str | None:
        """The grammar checked alone here (the agent checks it against its model's tokenizer
        and refuses with a clear error)."""
        return grammar_error(grammar)

    def load(self) -> tuple[int, int]:
        with self._lock:
            return self._active, self._waiting

    def submit(self, req: EngineRequest, emit: Callable[[EngineEvent], None],
               on_close: Callable[[], None] | None = None) -> _Handle:
        if req.text is None:
            raise ValueError("a fleet request needs its prompt text")
        with self._lock:
            if self._waiting >= self.max_queue:
                raise Overloaded(f"{self._waiting} requests are already waiting")
            self._waiting += 1
            h = _Handle(sid=self._next, prompt_tokens=len(req.prompt))
            self._next += 1
            self._live[h.sid] = h
        threading.Thread(target=self._run, args=(req, emit, on_close, h), daemon=True,
                         name=f"serve-remote-{h.sid}").start()
        return h

    def _run(self, req: EngineRequest, emit, on_close, h: _Handle) -> None:
        self._slots.acquire()
        with self._lock:
            self._waiting -= 1
            self._active += 1
            h.state = "decode"
        try:
            h.state = self._forward(req, emit, h)
        finally:
            with self._lock:
                self._active -= 1
                if h.state == "decode":
                    h.state = "failed"  # _forward raised: the thread logs it
                self._live.pop(h.sid, None)
                self._ended.append(h.view())
            self._slots.release()
            if on_close is not None:
                on_close()

    def _forward(self, req: EngineRequest, emit, h: _Handle) -> str:
        """Run one request on the verifier agent; returns how it ended (SESSION_STATES)."""
        if h.cancelled:
            return "cancelled"
        remote = ([c.card.router_endpoint for c in self.proposers]
                  if self.proposer_spec != "none" else [])
        busy_until = time.monotonic() + BUSY_WAIT_S
        while True:
            try:
                return self._stream(req, emit, h, remote)
            except ProtocolError as e:
                if e.code == FORBIDDEN and remote and not h.generated:
                    # a proposer the verifier will not reach: the answer goes on without it
                    named = refused_endpoint(str(e))
                    keep = [r for r in remote if r != named]
                    remote = keep if named and len(keep) < len(remote) else []
                    log.warning("verifier %s refused a proposer: %s; going on without %s",
                                self.verifier.card.name, e, named or "remote proposers")
                    continue
                # a verifier whose queue is full said so before any token: wait, not fail
                if e.code != BUSY or h.generated or time.monotonic() > busy_until:
                    emit(SessionFailed(f"verifier {self.verifier.card.name}: {e}"))
                    return "failed"
                if h.cancelled:
                    return "cancelled"
                time.sleep(BUSY_RETRY_S)
            except (PeerUnavailable, TransportTimeout) as e:
                self._lost_at = self._clock()  # 503s until it answers again (`alive`)
                log.error("verifier agent %s is gone: %s", self.verifier.card.name, e)
                emit(SessionFailed(f"verifier {self.verifier.card.name}: {e}"))
                return "failed"

    def _stream(self, req: EngineRequest, emit, h: _Handle, remote: list[str]) -> str:
        """One try: the request's tokens as the agent streams them (ProtocolError, transport
        errors raised)."""
        p = req.params
        n = 0
        for msg in generate_remote(self.verifier.card, self.key, prompt=req.text, chat=False,
                                   max_tokens=req.max_tokens, temperature=p.temperature,
                                   top_p=p.top_p, seed=p.seed,
                                   draft_tokens=self.draft_tokens,
                                   proposers=remote, proposer_spec=self.proposer_spec,
                                   top_logprobs=req.logprobs,
                                   grammar=((req.grammar.kind, req.grammar.source)
                                            if req.grammar is not None else ("", "")),
                                   cache_partition=req.partition,
                                   prediction=req.prediction):
            if h.cancelled:
                return "cancelled"  # closes the client; the agent finishes on its own
            if isinstance(msg, GenerateChunk) and msg.token_ids:
                n += 1
                h.times.commit(time.perf_counter())
                h.generated += len(msg.token_ids)
                if req.logprobs is not None:
                    emit(LogprobsCommitted(chunk_logprobs(msg)))
                emit(TokensCommitted(n, tuple(msg.token_ids)))
            elif isinstance(msg, GenerateDone):
                h.drafted, h.accepted = msg.stats.drafted, msg.stats.accepted
                if msg.cached_tokens:
                    emit(PromptReused(msg.cached_tokens))
                emit(Finished(msg.stats, tuple(msg.token_ids)))
                return "done"
        raise ProtocolError(INTERNAL, "the stream ended without GenerateDone")
