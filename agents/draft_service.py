"""The draft-model role (`--draft MODEL`): a small same-family model drafting ahead of a big
verifier, pushing each draft token (DraftChunk) as it exists, so it drafts while the verifier
verifies (docs/agents.md, "draft_service.py").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from agents.draft_stream import DraftStream
from agents.proposer_service import ComputeThread, ProposerLimits
from agents.specs import check_tokens
from bridge.errors import BAD_REQUEST, ProtocolError
from bridge.messages import (CloseSession, DraftChunk, SessionOpened, StreamCommit,
                             StreamOpen)
from bridge.transport import Reply
from macfleet.engine.controller import MAX_DRAFT_TOKENS
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers.base import Draft, draft_together
from macfleet.engine.proposers.model_draft import ModelProposer
from macfleet.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_LEAD = 2 * MAX_DRAFT_TOKENS + 2  # a lead the verifier may ask for
# after drafting streams together failed, the idle steps they draft alone (doubling)
APART_STEPS_MIN = 16
APART_STEPS_MAX = 1024


@dataclass
class _Session:
    stream: DraftStream
    reply: Reply  # the StreamOpen's replier: chunks go back on it
    max_lead: int
    basis: int = 0  # the commit the stream was last re-rooted at (0: the prompt)
    seq: int = 0  # the last commit applied

    @property
    def wants_token(self) -> bool:
        s = self.stream
        return not s.exhausted and len(s.stream) < self.max_lead

    def apply(self, msg: StreamCommit) -> None:
        """The verifier's commit: the stream goes on if it holds the committed tokens
        (`draft_stream.survives`), else it is re-rooted at this commit (its `basis`)."""
        st = self.stream
        if msg.seq != self.seq + 1 or msg.start != len(st.context):
            raise ProtocolError(BAD_REQUEST, f"commit {msg.seq} at {msg.start}: expected "
                                             f"{self.seq + 1} at {len(st.context)}")
        self.seq = msg.seq
        if not st.commit(msg.tokens):
            self.basis = msg.seq
        st.last_used = time.monotonic()

    def draft(self, sid: str) -> DraftChunk | None:
        """One more token on the stream, as the chunk that carries it (None: nothing new)."""
        t0 = time.perf_counter()
        d = self.stream.proposer.propose(self.stream.context + self.stream.stream, 1)
        return self.chunk(sid, d, (time.perf_counter() - t0) * 1e3)

    def job(self) -> tuple:
        """Its next token as a job of `draft_together` (proposer, context, 1)."""
        return self.stream.proposer, self.stream.context + self.stream.stream, 1

    def chunk(self, sid: str, d: Draft, ms: float) -> DraftChunk | None:
        """The stream's next tokens `d` appended, as the chunk that carries them (None:
        nothing new: the stream is exhausted)."""
        st = self.stream
        start = len(st.context) + len(st.stream)
        n = st.take(d)
        if not n:
            return None
        probs = np.stack(st.rows[-n:]).astype(np.float32) if st.want_probs and st.rows else None
        return DraftChunk(sid, self.basis, start, [int(t) for t in st.stream[-n:]], probs, ms)


class DraftAheadService(ComputeThread):
    """Draft-ahead sessions on one draft model: checks on the server's loop thread (`handle`),
    drafting on one compute thread (MLX work is serialised there)."""

    KIND = "draft-ahead"
    MESSAGES = (StreamOpen, StreamCommit, CloseSession)

    def _stream_of(self, s: _Session) -> DraftStream:
        return s.stream

    def __init__(self, draft: LoadedModel, *, serves: str,
                 limits: ProposerLimits = ProposerLimits()) -> None:
        """draft: the loaded draft model; serves: the verifier model spec it drafts for."""
        super().__init__(draft, limits)
        self.serves = serves
        self._draft_rows: dict = {}  # the sessions' caches: rows of one store (the model's)
        self._step = 0  # idle steps taken
        self._together_from = 0  # the step from which streams may be drafted together again
        self._apart_steps = APART_STEPS_MIN  # ... after the next failure
        self._start_compute("draft-ahead")

    def _check(self, msg, peer: bytes) -> None:
        if isinstance(msg, StreamCommit):
            self._owned(msg.session_id, peer)
            if msg.seq < 1 or msg.start < 0 or not 0 < len(msg.tokens) <= MAX_LEAD + 1:
                raise ProtocolError(BAD_REQUEST, f"a commit names 1..{MAX_LEAD + 1} tokens at a "
                                                 "position >= 0, with seq >= 1")
            check_tokens(msg.tokens, self.lm.vocab_size, "commit")
            return
        self._check_open(msg, self.serves)
        if not 1 <= msg.max_lead <= MAX_LEAD:
            raise ProtocolError(BAD_REQUEST, f"max_lead must be 1..{MAX_LEAD}")
        self._admit(msg.session_id, peer)

    # -- the compute thread
    def _busy(self) -> bool:
        return any(s.wants_token for s in self._sessions.values())

    def _serve_job(self, job) -> None:
        msg, reply, _ = job
        peer = getattr(reply, "peer", b"")
        self._answer(reply, lambda: self._serve(msg, reply, peer))

    def _serve(self, msg, reply: Reply, peer: bytes):
        if isinstance(msg, StreamOpen):
            self._make_room(msg.session_id, peer)
            self._drop(msg.session_id)  # re-opening a session replaces it
            params = SamplingParams(msg.temperature, msg.top_p, msg.seed)
            prop = ModelProposer(self.lm.model, name="draft")
            prop.start(params)
            self._sessions[msg.session_id] = _Session(
                DraftStream(prop, list(msg.prompt), want_probs=not params.greedy,
                            cross_round=True), reply, msg.max_lead)
            self._owner[msg.session_id] = peer
            return SessionOpened(msg.session_id, f"draft:{self.lm.spec}", self.lm.vocab_size)
        if isinstance(msg, CloseSession):
            return self._close_session(msg, peer)
        self._owned(msg.session_id, peer)
        self._sessions[msg.session_id].apply(msg)
        return None  # one-way

    def _idle_step(self) -> None:
        """One more token on every session's stream in one forward (`draft_together`), or
        else on one session's (round-robin); each pushed at once."""
        live = [(sid, s) for sid, s in self._sessions.items() if s.wants_token]
        self._step += 1
        # drafted together from now on (alone, a stream's own cache is cheaper), unless that
        # failed lately
        if len(live) > 1 and self._step >= self._together_from:
            for _, s in live:
                if s.stream.proposer.rows is None:
                    s.stream.proposer.share_rows(self._draft_rows)
        together = [(sid, s) for sid, s in live if s.stream.proposer.rows is not None]
        if len(together) > 1:
            t0 = time.perf_counter()
            try:
                drafts = draft_together([s.job() for _, s in together])
            except Exception:  # each on its own for a while: a failure ends one stream only
                log.exception("drafting %d streams together failed; alone for the next %d "
                              "steps", len(together), self._apart_steps)
                self._together_from = self._step + self._apart_steps
                self._apart_steps = min(2 * self._apart_steps, APART_STEPS_MAX)
                drafts = None
            if drafts is not None:  # each stream's token took the whole step to come: the
                ms = (time.perf_counter() - t0) * 1e3  # verifier waits by it (tokens_to_wait)
                self._apart_steps = APART_STEPS_MIN
                for (sid, s), d in zip(together, drafts):
                    self._push(s, s.chunk(sid, d, ms))
                return
            for _, s in together:
                s.stream.proposer.close()  # its cache rebuilt from its context, alone
        if not live:
            return
        self._rr = (self._rr + 1) % len(live)
        sid, s = live[self._rr]
        try:
            chunk = s.draft(sid)
        except Exception:  # a drafting failure ends this stream, never the service
            log.exception("draft-ahead session %s failed; its stream stops", sid)
            s.stream.exhausted = True
            return
        self._push(s, chunk)

    def _push(self, s: _Session, chunk: DraftChunk | None) -> None:
        if chunk is not None:
            s.reply(chunk)
