"""The proposer role: draft blocks for many verifier sessions at once, on one compute thread
that serves requests first come first served, drafts ahead in idle time and shares its
session slots fairly (docs/agents.md, "proposer_service.py").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agents.draft_stream import DraftStream
from agents.proposer_chains import ChainRounds
from agents.specs import (PROPOSER_KINDS, DraftModels, SpecPolicy, check_id, check_sampling,
                          check_spec, check_tokens, make_checked_proposer)
from bridge.errors import BAD_REQUEST, BAD_SHAPE, BUSY, INTERNAL, NOT_FOUND, ProtocolError
from bridge.messages import (CloseSession, DraftReply, DraftRequest, ErrorReply, HiddenStates,
                             HiddenStatesAck, OpenSession, SessionClosed, SessionOpened)
from bridge.transport import Reply
from macfleet.engine.controller import MAX_DRAFT_TOKENS
from macfleet.engine.models import LoadedModel, ModelSpecError
from macfleet.engine.batch import BatchKV
from macfleet.engine.proposers.eagle.chain import EagleProposer
from macfleet.engine.proposers import ProposerSpecError
from macfleet.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ProposerLimits:
    max_sessions: int = 16
    idle_evict_s: float = 30.0
    max_k: int = MAX_DRAFT_TOKENS  # what any verifier may ask for (engine/controller.py)
    max_prompt: int = 32768
    max_sessions_per_client: int = 4
    reclaim_idle_s: float = 3.0


# -- session slots: who gets a drafting session when the slots run out (pure) ----------------
def reclaimable(last_used: dict[str, float], now: float, min_idle_s: float) -> str | None:
    """The session idle longest, when it has been idle at least min_idle_s (pure)."""
    if not last_used:
        return None
    sid = min(last_used, key=last_used.__getitem__)
    return sid if now - last_used[sid] >= min_idle_s else None


@dataclass(frozen=True)
class Slot:
    """Whether a client may open one more session, and which session gives way for it."""

    ok: bool
    evict: str | None = None
    why: str = ""


def slot_for(peer: bytes, owners: dict[str, bytes], last_used: dict[str, float], now: float,
             limits: ProposerLimits) -> Slot:
    """A new session for client `peer` (pure): admitted under the per-client cap and the total;
    when every slot is taken, the session idle `reclaim_idle_s` gives way, else (fair share) the
    least recently used one of the client holding the most, when it holds more than `peer` would
    (docs/agents.md, "Session slots")."""
    mine = sum(1 for o in owners.values() if o == peer)
    if mine >= limits.max_sessions_per_client:
        return Slot(False, why=f"this client holds {mine} drafting sessions (the limit per "
                               "client); close one first")
    if len(owners) < limits.max_sessions:
        return Slot(True)
    idle = reclaimable(last_used, now, limits.reclaim_idle_s)
    if idle is not None:
        return Slot(True, idle)
    held: dict[bytes, list[str]] = {}
    for sid, o in owners.items():
        held.setdefault(o, []).append(sid)
    top = max(held.values(), key=len)
    if len(top) > mine + 1:
        return Slot(True, min(top, key=lambda sid: last_used.get(sid, 0.0)))
    return Slot(False, why=f"{len(owners)} sessions open (the limit), all of them active and "
                           "shared fairly")


def _learn(s: DraftStream, msg: DraftRequest) -> None:
    """Give a tree drafter what the verifier measured: its verify(L) table (first request)
    and what became of the previous draft, as a local group of drafters is told."""
    lengths, ms = msg.verify_lengths, msg.verify_costs_ms
    if lengths and ms and len(lengths) == len(ms):
        s.proposer.seed_verify_costs({int(L): float(c) for L, c in zip(lengths, ms)
                                      if 1 <= int(L) <= MAX_VERIFY_LENGTH and 0 < c < 1e6})
    drafted = s.last_drafted
    if 0 <= msg.last_accepted <= drafted and 0 < msg.last_verify_ms < 1e6:
        s.proposer.observe(drafted, msg.last_accepted, msg.last_verify_ms,
                           msg.last_verified if 0 < msg.last_verified <= MAX_VERIFY_LENGTH
                           else None)


MAX_VERIFY_LENGTH = 4096  # a verified block larger than this is a lie, not a measurement


def check_features(msg: DraftRequest, hidden_size: int) -> None:
    """A draft request's F3 rows (shape, int8 scales); ProtocolError otherwise."""
    f, sc = msg.features, msg.features_scale
    if f is not None and (f.ndim != 2 or f.shape[1] != hidden_size or msg.features_start < 0):
        raise ProtocolError(BAD_SHAPE, f"features must be [n, {hidden_size}] "
                                       f"from a position >= 0, got {f.shape}")
    if sc is not None and (f is None or f.dtype != np.int8 or sc.shape != (len(f),)):
        raise ProtocolError(BAD_SHAPE, "features_scale needs int8 features, one per row")


class ComputeThread(ABC):
    """The shell of the proposer and draft-model roles: one compute thread (`_run`) serving
    `_jobs` in order (None stops it) and idle work while `_busy`; sessions in `_sessions` (a
    DraftStream, or holding one: `_stream_of`), their openers in `_owner`."""

    KIND = "drafting"  # what its sessions are called in errors and logs
    MESSAGES: tuple[type, ...] = ()  # the requests it serves, CloseSession among them
    BAD_REQUESTS: tuple[type[Exception], ...] = ()  # a job's errors that are the request's fault
    IDLE_WAIT_S = 0.05  # how long the thread waits for a job while it has no idle work

    def __init__(self, lm: LoadedModel, limits: ProposerLimits) -> None:
        self.lm, self.limits = lm, limits
        self._sessions: dict = {}
        self._owner: dict[str, bytes] = {}  # session -> the client connection that opened it
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._rr = 0  # the session whose idle work is next (round-robin)

    def _stream_of(self, s) -> DraftStream:
        return s

    # -- the server's loop thread: check, then queue for the compute thread
    def handle(self, msg, reply: Reply) -> bool:
        """False when the message is not for this service."""
        if not isinstance(msg, self.MESSAGES):
            return False
        check_id(msg.session_id, "session_id")
        peer = getattr(reply, "peer", b"")
        if not isinstance(msg, CloseSession):
            self._check(msg, peer)
        elif msg.session_id in self._sessions:
            self._owned(msg.session_id, peer)
        self._jobs.put((msg, reply, time.perf_counter()))
        return True

    @abstractmethod
    def _check(self, msg, peer: bytes) -> None:
        """An open or a session's request checked before it is queued (ProtocolError)."""

    def _check_open(self, msg, serves: str) -> None:
        """An opening session's model (`serves`: the one it drafts for), prompt ids and
        sampling parameters (ProtocolError)."""
        if msg.model not in ("", serves):
            raise ProtocolError(BAD_REQUEST, f"this agent drafts for '{serves}', not '{msg.model}'")
        if not msg.prompt or len(msg.prompt) > self.limits.max_prompt:
            raise ProtocolError(BAD_REQUEST, f"prompt must be 1..{self.limits.max_prompt} tokens")
        check_tokens(msg.prompt, self.lm.vocab_size, "prompt")
        check_sampling(msg.temperature, msg.top_p, msg.seed)

    def _owned(self, sid: str, peer: bytes) -> None:
        """NOT_FOUND unless session `sid` exists and was opened by this client connection."""
        if sid not in self._sessions or self._owner.get(sid) != peer:
            raise ProtocolError(NOT_FOUND, f"no {self.KIND} session '{sid}'")

    def _admit(self, sid: str, peer: bytes) -> str | None:
        """Session `sid` opening: re-opening is its opener's alone (NOT_FOUND), a new session
        takes a slot (slot_for; BUSY when there is none); returns the session giving way."""
        if sid in self._sessions:
            self._owned(sid, peer)
            return None
        last = {s: self._stream_of(st).last_used for s, st in list(self._sessions.items())}
        slot = slot_for(peer, dict(self._owner), last, time.monotonic(), self.limits)
        if not slot.ok:
            raise ProtocolError(BUSY, slot.why)
        return slot.evict

    def _make_room(self, sid: str, peer: bytes) -> None:
        """`_admit` again on the compute thread (other opens may have been queued since
        `handle`), the session that gives way dropped."""
        evict = self._admit(sid, peer)
        if evict is not None:
            log.info("%s session %s gives way to a new one", self.KIND, evict)
            self._drop(evict)

    def _close_session(self, msg: CloseSession, peer: bytes) -> SessionClosed:
        if msg.session_id in self._sessions:
            self._owned(msg.session_id, peer)
            self._drop(msg.session_id)
        return SessionClosed(msg.session_id)

    def _drop(self, sid: str) -> None:
        s = self._sessions.pop(sid, None)
        self._owner.pop(sid, None)
        if s is not None:
            self._stream_of(s).proposer.close()

    def _evict_idle(self) -> None:
        now = time.monotonic()
        for sid, s in list(self._sessions.items()):
            if now - self._stream_of(s).last_used > self.limits.idle_evict_s:
                log.info("evicting idle %s session %s", self.KIND, sid)
                self._drop(sid)

    def _answer(self, reply: Reply, serve: Callable[[], object]) -> None:
        """One job on the compute thread: its answer (None: one-way) or its error goes back;
        the daemon never dies of a request."""
        try:
            out = serve()
            if out is not None:
                reply(out)
        except ProtocolError as e:
            reply(ErrorReply(e.code, str(e)))
        except self.BAD_REQUESTS as e:
            reply(ErrorReply(BAD_REQUEST, str(e)))
        except Exception as e:
            log.exception("%s job failed", self.KIND)
            reply(ErrorReply(INTERNAL, f"{type(e).__name__}: {e}"))

    def _start_compute(self, name: str) -> None:
        """Last in a constructor, once every field `_run` reads is set."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._next_job()
            except queue.Empty:
                self._idle_step()
                self._evict_idle()
                continue
            if job is None:
                break
            self._serve_job(job)

    def _next_job(self):
        """The next job; while there is idle work, only one already waiting (queue.Empty)."""
        return self._jobs.get_nowait() if self._busy() else self._jobs.get(
            timeout=self.IDLE_WAIT_S)

    def _busy(self) -> bool:
        """Whether there is idle work (`_idle_step`) to do between jobs."""
        return False

    def _idle_step(self) -> None:
        """One step of idle work, between jobs."""

    @abstractmethod
    def _serve_job(self, job) -> None:
        """One job taken off the queue (each service's own request kinds)."""

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(timeout)


class ProposerService(ComputeThread):
    """The proposer role: requests checked on the server's loop thread (`handle`), drafting
    on one compute thread (chain rounds: `chains`), lookahead in idle time, idle eviction."""

    BAD_REQUESTS = (ModelSpecError, ProposerSpecError, ValueError)
    MESSAGES = (OpenSession, DraftRequest, CloseSession)

    def __init__(self, lm: LoadedModel, *,
                 kinds: tuple[str, ...] = PROPOSER_KINDS,
                 limits: ProposerLimits = ProposerLimits(), heads_dir: str | None = None,
                 allow_hub: bool = False) -> None:
        super().__init__(lm, limits)
        self.policy = SpecPolicy(kinds=kinds, heads_dir=heads_dir, own_model=lm.spec,
                                 allow_hub=allow_hub, vocab_size=lm.vocab_size)
        self.models = DraftModels()
        self._draft_rows: dict[int, BatchKV] = {}  # chain sessions' caches, one store a model
        self.chains = ChainRounds(self._sessions, self._jobs, update=self._update,
                                  answer=self._answer, drafted=self._drafted)
        # tokens whose features a drafter computed itself, not sent over F3 (closed sessions too)
        self.fallback_tokens = 0
        self._start_compute("proposer-compute")
        if "retrieval" in kinds:
            # the answer store's index takes seconds to build: before the agent is advertised
            from macfleet.engine.proposers.retrieval import warm_store

            warm_store(lm.spec)

    def handle(self, msg, reply: Reply) -> bool:
        if isinstance(msg, HiddenStates):
            # F3 probes, acknowledged at once: the verifier measures the wire cost only
            reply(HiddenStatesAck(msg.session_id, msg.block, int(msg.states.nbytes)))
            return True
        return super().handle(msg, reply)

    def _check(self, msg, peer: bytes) -> None:
        if isinstance(msg, DraftRequest):
            if not 0 <= msg.k <= self.limits.max_k:
                raise ProtocolError(BAD_REQUEST, f"k must be 0..{self.limits.max_k}, got {msg.k}")
            self._owned(msg.session_id, peer)
            check_features(msg, self.lm.hidden_size)
            return
        if not isinstance(msg.proposer, str) or "+" in msg.proposer:
            raise ProtocolError(BAD_REQUEST, "a drafting session runs one drafter, not a+b")
        check_spec(msg.proposer, self.policy)
        self._check_open(msg, self.lm.spec)
        self._admit(msg.session_id, peer)

    def _drop(self, sid: str) -> None:
        s = self._sessions.get(sid)
        if s is not None:
            self.fallback_tokens += s.proposer.fallback_tokens
        super()._drop(sid)

    # -- compute thread
    def _next_job(self):
        """Jobs held back while a chain round was gathered come first."""
        return self.chains.held.popleft() if self.chains.held else super()._next_job()

    def _serve_job(self, job) -> None:
        msg, reply, received = job
        if self.chains.chained(msg):
            self.chains.serve(job)
        else:
            self._answer(reply, lambda: self._serve(msg, received, getattr(reply, "peer", b"")))

    def _update(self, msg: DraftRequest, peer: bytes) -> DraftStream:
        """A draft request's session (its opener's), its context and features brought up to date."""
        self._owned(msg.session_id, peer)
        s = self._sessions[msg.session_id]
        check_tokens(msg.committed, self.lm.vocab_size, "committed")
        s.commit(msg.committed)
        if msg.features is not None and s.proposer.wants_features:
            a = msg.features_start
            n = min(len(msg.features), len(s.context) - a)  # rows of committed positions only
            if n > 0:
                feats = msg.features[:n]
                if msg.features_scale is not None:
                    from macfleet.engine.proposers.eagle.f3codec import decode_int8

                    feats = decode_int8(feats, msg.features_scale[:n])
                s.proposer.feed_features(a, s.context[a : a + n], feats)
        return s

    def _serve(self, msg, received: float, peer: bytes = b""):
        """received: when the request reached this agent (the reply's draft_ms counts from then:
        docs/agents.md, "proposer_service.py")."""
        if isinstance(msg, OpenSession):
            self._make_room(msg.session_id, peer)
            prop = make_checked_proposer(msg.proposer, self.lm, self.policy, self.models)
            if isinstance(prop, EagleProposer):
                # features arrive over F3; never tap this process's model (agents sharing a
                # process would otherwise swap hidden states across threads)
                prop.use_tap = False
            if prop is None:
                raise ProtocolError(BAD_REQUEST, "proposer 'none' drafts nothing")
            params = SamplingParams(msg.temperature, msg.top_p, msg.seed)
            prop.start(params)
            # a hidden-state drafter cannot pre-draft ahead of the verifier's features
            lookahead = msg.cross_round and not prop.wants_features
            if not lookahead:  # chains drafted with other sessions' (a session drafting
                prop.share_rows(self._draft_rows)  # ahead in idle time drafts alone)
            self._drop(msg.session_id)  # re-opening a session replaces it
            self._sessions[msg.session_id] = DraftStream(
                prop, list(msg.prompt), want_probs=not params.greedy, cross_round=lookahead)
            self._owner[msg.session_id] = peer
            return SessionOpened(msg.session_id, prop.name, self.lm.vocab_size)
        if isinstance(msg, CloseSession):
            return self._close_session(msg, peer)
        s = self._update(msg, peer)
        if s.proposer.drafts_trees:  # a dynamic tree: drafted early in idle time, or now
            _learn(s, msg)
            d = s.take_tree(msg.k) if s.cross_round else None
            hit = d is not None
            if d is None:
                d = s.proposer.propose(s.context, msg.k)
            s.last_drafted, s.last_k = len(d.tokens), msg.k
            s.replied_tree(d)
            return self._drafted(msg, received, d.tokens, None, hit,
                                 parents=None if d.parents is None else list(d.parents))
        r = s.draft(msg.k)
        return self._drafted(msg, received, r.tokens, r.probs, r.predraft_hit)

    def _drafted(self, msg: DraftRequest, received: float, tokens, probs, hit: bool,
                 parents: list[int] | None = None) -> DraftReply:
        """A block's reply, counted; its draft_ms counts from when the request reached this
        agent."""
        return DraftReply(session_id=msg.session_id, block=msg.block, tokens=list(tokens),
                          probs=probs, draft_ms=(time.perf_counter() - received) * 1e3,
                          predraft_hit=hit, parents=parents)

    def _busy(self) -> bool:
        """Lookahead pending: a session's stream to extend."""
        return any(s.wants_lookahead() for s in self._sessions.values())

    def _idle_step(self) -> None:
        """Lookahead: extend one session's stream by one token (round-robin)."""
        live = [s for s in list(self._sessions.values()) if s.wants_lookahead()]
        if not live:
            return
        self._rr = (self._rr + 1) % len(live)
        try:
            s = live[self._rr]
            s.predraft_tree() if s.proposer.drafts_trees else s.extend(1)
        except Exception:  # a lookahead failure must not kill the service: drop that stream
            log.exception("lookahead failed; dropping the speculative stream")
            live[self._rr].stream.clear()
            live[self._rr].rows.clear()
            live[self._rr].exhausted = True
