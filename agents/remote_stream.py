"""A draft-model agent drafting ahead, seen by the verifier's loop as a local `Proposer`: a block
sends what was committed (F1, one-way) and takes the drafts the agent pushed, waiting only for
as many more as pay (docs/agents.md, "remote_stream.py"). Failures raise `ProposerFailed`.
"""

from __future__ import annotations

import bisect
import logging
import time
import uuid
from dataclasses import replace
from collections.abc import Mapping, Sequence

import numpy as np

from agents.draft_stream import survives
from agents.remote_proposer import DEFAULT_OPEN_TIMEOUT_S, OPEN_GRACE_S, FlowTotals, connect
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import (CloseSession, DraftChunk, ErrorReply, SessionOpened, StreamCommit,
                             StreamOpen)
from bridge.transport import Client
from macfleet.engine.controller import tokens_to_wait
from macfleet.engine.proposers.base import Draft, Proposer, ProposerFailed
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.verify_costs import verify_ms_at
from macfleet.stats import FlowStats

log = logging.getLogger(__name__)

SILENCE_S = 5.0  # an agent that pushes nothing this long while drafts are owed is dead
LEAD = 2 * 12 + 2  # tokens the agent may draft past what it knows is committed
_EMA = 0.2
_TRANSIT_MS = 0.3  # a chunk's way from the agent's compute thread to this one, on a LAN
CLOSE_LINGER_MS = 500  # a CloseSession sent as the socket closes may take this long to leave


class AheadMirror:
    """This side's copy of an agent's draft stream past the committed context (no I/O).

    Chunks name their basis (the commit their stream was re-rooted at); those of a basis known
    refuted are dropped, by the rule the agent applies too (`draft_stream.survives`)."""

    def __init__(self, context: Sequence[int]) -> None:
        self.ctx = [int(t) for t in context]  # the committed context
        self.seq = 0  # commits sent
        self._ends: list[int] = []  # _ends[i]: the context length after commit i + 1
        self.basis = 0  # the basis of the chunks kept
        self.min_basis = 0  # chunks of older bases are refuted
        self.toks: list[int] = []  # drafts at positions len(ctx)..
        self.rows: list[np.ndarray] = []  # their draft distributions (sampling)
        self.end = len(self.ctx)  # where the next chunk of `basis` starts
        self.received = 0  # draft tokens received
        self.wasted = 0  # ... refuted before they could be verified, or never used

    def commit(self, tokens: Sequence[int]) -> int:
        """The verifier committed `tokens` after the context; returns the commit's seq."""
        tokens = [int(t) for t in tokens]
        self.seq += 1
        if self.basis < self.min_basis:
            pass  # awaiting a re-rooted stream: its chunks are checked against these as they come
        elif survives(self.toks, tokens):
            n = min(len(tokens), len(self.toks))
            del self.toks[:n]
            del self.rows[:n]
        else:  # refuted by what it showed: the agent re-roots at this commit when it sees it
            agreed = next(i for i, (a, b) in enumerate(zip(self.toks, tokens)) if a != b)
            self.wasted += len(self.toks) - agreed
            self.toks.clear()
            self.rows.clear()
            self.min_basis = self.seq
        self.ctx.extend(tokens)
        self._ends.append(len(self.ctx))
        return self.seq

    def _seq_of(self, pos: int) -> int:
        """The commit that committed position `pos` of the context."""
        return bisect.bisect_right(self._ends, pos) + 1

    def add(self, chunk: DraftChunk) -> None:
        """A chunk pushed by the agent."""
        n = len(chunk.tokens)
        self.received += n
        if chunk.basis < max(self.basis, self.min_basis):
            self.wasted += n
            return
        if chunk.basis > self.basis:  # the agent re-rooted (at a commit we saw refute it)
            self.wasted += len(self.toks)
            self.basis, self.toks, self.rows, self.end = chunk.basis, [], [], chunk.start
        if self.end < chunk.start <= len(self.ctx):
            # the agent's stream was shorter than a commit: it went on from the commit's end,
            # past positions this side already holds as committed
            self.end = chunk.start
        if chunk.start != self.end:  # not the continuation of what we hold: ignore it
            log.debug("chunk at %d (basis %d) is not the continuation (at %d, basis %d, "
                      "context %d)", chunk.start, chunk.basis, self.end, self.basis,
                      len(self.ctx))
            self.wasted += n
            return
        self.end = chunk.start + n
        rows = chunk.probs if chunk.probs is not None and len(chunk.probs) == n else None
        for i, t in enumerate(chunk.tokens):
            pos = chunk.start + i
            if pos < len(self.ctx):
                if int(t) != self.ctx[pos]:  # refuted by a commit the agent had not seen
                    self.min_basis = max(self.min_basis, self._seq_of(pos))
                    self.wasted += n - i + len(self.toks)
                    self.toks.clear()
                    self.rows.clear()
                    return
                continue
            if pos != len(self.ctx) + len(self.toks):
                return
            self.toks.append(int(t))
            if rows is not None:
                self.rows.append(rows[i])

    def drafts(self, k: int) -> tuple[list[int], np.ndarray | None]:
        """Up to k drafts continuing the context, and their distributions when all have one."""
        if self.basis < self.min_basis:
            return [], None
        toks = self.toks[:k]
        probs = np.stack(self.rows[: len(toks)]) if toks and len(self.rows) >= len(toks) \
            else None
        return toks, probs

    @property
    def have(self) -> int:
        return len(self.toks) if self.basis >= self.min_basis else 0


class StreamingProposer(Proposer):
    """Drafts from a draft-model agent's pushed stream (`begin` sends the commit and takes what
    arrived; `finish` waits for what pays)."""

    paced = True

    spec = "draft"
    f3_probe_width = 0  # (never probes F3: `verifier_drafting.probed`)

    def __init__(self, endpoint: str, *, key: bytes | None, model: str) -> None:
        self.endpoint = endpoint
        self.key = key
        self.model = model
        self.name = f"draft@{endpoint}"
        self._client: Client | None = None
        self._mirror: AheadMirror | None = None
        self._session = ""
        self._opening = ""
        self._open_by = 0.0
        self._k = 0
        self._t_begin = 0.0
        self._heard = 0.0  # when the agent last pushed something
        self._token_ms: float | None = None  # the agent's time per draft token (EMA)
        self._alpha = 0.8  # per-token acceptance (EMA), optimistic at first
        self._costs: dict[int, float] = {}  # verify(L) in ms, measured or seeded
        self._lead = 0
        self._sent_bytes = self._recv_bytes = 0
        self.start(GREEDY)

    # -- the Proposer interface
    def start(self, params: SamplingParams = GREEDY) -> None:
        self.close()
        self._received = self._wasted = 0  # drafts of sessions already closed (`waste`)
        self.params = params
        self.flows = FlowTotals()
        self._lead_sum = self._lead_n = 0  # drafts waiting when blocks began (for `lead`)
        self._wait_ms = 0.0

    def seed_verify_costs(self, costs: Mapping[int, float]) -> None:
        self._costs.update({int(k): float(v) for k, v in costs.items()})

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        L = int(verified or drafted + 1)
        if verify_ms > 0:
            old = self._costs.get(L)
            self._costs[L] = verify_ms if old is None else (1 - _EMA) * old + _EMA * verify_ms
        if drafted > 0:
            trials = accepted + (1 if accepted < drafted else 0)
            if trials:
                self._alpha = min(0.98, max(0.02, (1 - _EMA) * self._alpha
                                            + _EMA * accepted / trials))

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self.begin(context, k)
        return self.finish()

    def begin(self, context: Sequence[int], k: int) -> None:
        """Send what was committed since the last block (F1) and take what the agent pushed;
        opens the session on the first block, or when the context does not continue it."""
        self._t_begin = time.perf_counter()
        self._k = k
        if self._mirror is None or not self._continues(context):
            self._open(context)
        elif not self._await_open():
            return  # commits wait for the session: the agent drafts from the prompt meanwhile
        m = self._mirror
        delta = [int(t) for t in context[len(m.ctx):]]
        if delta and self._session:
            seq = m.commit(delta)
            self._send(StreamCommit(self._session, seq, len(context) - len(delta), delta))
        if self._session:
            self._drain(0.0)
        self._lead = m.have
        self._lead_sum += m.have
        self._lead_n += 1

    def finish(self) -> Draft:
        """The drafts there, after waiting for as many more as pay for their wait."""
        m = self._mirror
        if m is None or not self._session and not self._await_open():
            return Draft((), None, 0.0)
        k = self._k
        t0 = time.perf_counter()
        while m.have < k:
            due = self._due_ms()
            want = tokens_to_wait(m.have, k, self._alpha, self._token_ms or due, due,
                                  self._verify_ms)
            if want == 0:
                break
            have = m.have
            budget_s = (due + (want - 1) * (self._token_ms or due)) / 1e3 * 1.5 + 0.002
            self._drain(budget_s, until=have + want)
            if m.have <= have:  # nothing came when it was due: verify what there is
                if time.perf_counter() - self._heard > SILENCE_S:
                    raise ProposerFailed(f"{self.endpoint}: no drafts for "
                                         f"{SILENCE_S:.0f} s")
                break
        toks, probs = m.drafts(k)
        wait_ms = (time.perf_counter() - t0) * 1e3
        log.debug("block: k %d, %d drafts there (basis %d/%d, %d received, %d wasted), waited "
                  "%.1f ms", k, m.have, m.basis, m.min_basis, m.received, m.wasted, wait_ms)
        self._wait_ms += wait_ms
        if not self.params.greedy and toks and probs is None:
            toks = []  # sampled drafts without their distribution cannot be accepted exactly
        # the wire is off the critical path (chunks arrive while the verifier verifies); what
        # the verifier spends on drafting is this wait for the agent's compute
        self.flows.add(self._sent_bytes, self._recv_bytes, 0.0, wait_ms, self._lead > 0)
        self.flows.last = replace(self.flows.last, ahead_lead=self._lead,
                                  ahead_waste=self.waste)
        self._sent_bytes = self._recv_bytes = 0
        return Draft(tuple(toks), probs, (time.perf_counter() - self._t_begin) * 1e3)

    def close(self) -> None:
        if self._mirror is not None:  # its figures outlive the session (`waste`)
            self._received += self._mirror.received
            self._wasted += self._mirror.wasted
        if self._client is not None:
            linger = 0
            if self._session or self._opening:  # (its answer may not have been read yet)
                try:
                    self._client.send(CloseSession(self._session or self._opening))
                    linger = CLOSE_LINGER_MS  # (closed at once, the socket would drop it)
                except PeerUnavailable:
                    pass  # the agent evicts idle sessions by itself
            self._client.close(linger)
            self._client = None
        self._session = self._opening = ""
        self._mirror = None

    # -- what the dashboard and the stats show
    @property
    def lead(self) -> float:
        """Drafts already waiting when a block began, on average."""
        return self._lead_sum / self._lead_n if self._lead_n else 0.0

    @property
    def waste(self) -> float:
        """The share of the drafts received that were thrown away (refuted before use)."""
        m = self._mirror
        received = self._received + (m.received if m is not None else 0)
        wasted = self._wasted + (m.wasted if m is not None else 0)
        return wasted / received if received else 0.0

    def flow_stats(self) -> FlowStats:
        s = self.flows.summary()
        return replace(s, ahead_lead=self.lead, ahead_waste=self.waste,
                       ahead_wait_ms=self._wait_ms / max(self.flows.blocks, 1),
                       ahead_token_ms=max(0.0, (self._token_ms or _TRANSIT_MS) - _TRANSIT_MS))

    # -- internals
    def _continues(self, context: Sequence[int]) -> bool:
        m = self._mirror
        return len(context) >= len(m.ctx) and list(context[: len(m.ctx)]) == m.ctx

    def _verify_ms(self, L: int) -> float:
        """verify(L) from what was measured (a guess before anything was)."""
        if not self._costs:
            return 100.0 * (1 + 0.05 * (L - 1))
        return max(verify_ms_at(self._costs, L), 1e-3)

    def _due_ms(self) -> float:
        """Time until the agent's next token is expected."""
        if self._token_ms is None:
            return 50.0
        since = (time.perf_counter() - self._heard) * 1e3
        return max(0.5, self._token_ms - since)

    def _open(self, context: Sequence[int]) -> None:
        self.close()
        self._client = connect(self.endpoint, self.key)
        self._mirror = AheadMirror(context)
        self._opening = uuid.uuid4().hex[:16]
        msg = StreamOpen(self._opening, self.model, [int(t) for t in context],
                         self.params.temperature, self.params.top_p, self.params.seed,
                         LEAD)
        self._open_by = time.monotonic() + DEFAULT_OPEN_TIMEOUT_S
        self._heard = time.perf_counter()
        try:
            self._client.send(msg)
        except PeerUnavailable as e:
            raise ProposerFailed(f"cannot open a draft-ahead session on {self.endpoint}: "
                                 f"{e}") from e
        self._await_open(OPEN_GRACE_S)

    def _await_open(self, wait_s: float = 0.0) -> bool:
        """Whether the session is open, reading its answer if it came within wait_s."""
        if self._session:
            return True
        if not self._opening:
            return False
        self._drain(wait_s, until_open=True)
        if not self._session and time.monotonic() > self._open_by:
            raise ProposerFailed(f"cannot open a draft-ahead session on {self.endpoint}: no "
                                 f"answer within {DEFAULT_OPEN_TIMEOUT_S:.0f} s")
        return bool(self._session)

    def _send(self, msg) -> None:
        try:
            self._client.send(msg, session=self._session)
        except PeerUnavailable as e:
            raise ProposerFailed(f"{self.endpoint}: {e}") from e
        self._sent_bytes += self._client.last_sent_bytes

    def _drain(self, wait_s: float, *, until: int | None = None,
               until_open: bool = False) -> None:
        """Read what the agent sent: everything already here, then until `until` drafts are
        there (or the session is open) or wait_s has passed."""
        m = self._mirror
        deadline = time.perf_counter() + wait_s
        while True:
            done = (self._session if until_open else
                    until is not None and m.have >= until)
            left = 0.0 if done else max(0.0, deadline - time.perf_counter())
            try:
                env = self._client.recv(left)
            except TransportTimeout:
                return
            except (ProtocolError, PeerUnavailable) as e:
                raise ProposerFailed(f"{self.endpoint}: {e}") from e
            self._take(env.msg)

    def _take(self, msg) -> None:
        now = time.perf_counter()
        if isinstance(msg, DraftChunk):
            if msg.session_id != self._session:
                return  # a stray chunk of a session closed before
            step = msg.draft_ms / max(len(msg.tokens), 1) + _TRANSIT_MS
            self._token_ms = step if self._token_ms is None else \
                (1 - _EMA) * self._token_ms + _EMA * step
            self._heard = now
            self._mirror.add(msg)
            self._recv_bytes += self._client.last_recv_bytes
        elif isinstance(msg, SessionOpened) and msg.session_id == self._opening:
            self._session, self._opening = msg.session_id, ""
            self.name = f"{msg.proposer}@{self.endpoint}"
            self._heard = now
        elif isinstance(msg, ErrorReply):
            raise ProposerFailed(f"{self.endpoint}: {msg.code}: {msg.message}")
