"""A proposer on another agent, seen by the verifier's loop as a local `Proposer`.

Per block it sends the tokens committed since the last request (F1) and receives the draft
(F2), measuring both flows (docs/agents.md, "remote_proposer.py"). Any failure raises
`ProposerFailed`: a dead proposer costs speed, never tokens.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import (CloseSession, DraftReply, DraftRequest, ErrorReply, HiddenStates,
                             HiddenStatesAck, OpenSession, SessionOpened)
from bridge.transport import Client
from macfleet.engine.proposers import drafts_tree
from macfleet.engine.proposers.base import Draft, Proposer, ProposerFailed
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.stats import BlockFlows, FlowStats

log = logging.getLogger(__name__)

DEFAULT_DRAFT_TIMEOUT_S = 5.0  # a proposer slower than this is useless anyway
DEFAULT_OPEN_TIMEOUT_S = 30.0  # first contact may load a model
# the first block waits this long for its session to open (a ready agent answers in ~1 ms)
OPEN_GRACE_S = 0.05
# a proposer that has not completed the (CURVE) handshake by then is taken as dead
DEFAULT_CONNECT_TIMEOUT_S = 0.5


@dataclass
class FlowTotals:
    """Running totals of one remote proposer's flows; `last` is the block just verified."""

    blocks: int = 0
    f1_bytes: int = 0
    f2_bytes: int = 0
    f1_ms: float = 0.0
    f2_ms: float = 0.0
    f3_bytes: int = 0
    f3_ms: float = 0.0
    compute_ms: float = 0.0
    predraft_hits: int = 0
    last: BlockFlows | None = None

    def add(self, b1: int, b2: int, wire_ms: float, compute_ms: float, hit: bool,
            b3: int = 0, f3_ms: float = 0.0) -> None:
        share1 = b1 / (b1 + b2) if b1 + b2 else 0.5
        last = BlockFlows(f1_bytes=b1, f2_bytes=b2, f3_bytes=b3, f1_ms=wire_ms * share1,
                          f2_ms=wire_ms * (1 - share1), f3_ms=f3_ms, compute_ms=compute_ms,
                          predraft_hit=hit)
        self += FlowTotals(blocks=1, f1_bytes=b1, f2_bytes=b2, f1_ms=last.f1_ms, f2_ms=last.f2_ms,
                           f3_bytes=b3, f3_ms=f3_ms, compute_ms=compute_ms, predraft_hits=int(hit))
        self.last = last

    def __iadd__(self, other: FlowTotals) -> FlowTotals:
        for f in fields(self):
            if f.name != "last":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def summary(self, *, f3_probe: bool = False) -> FlowStats:
        """Per-block averages (zeros when no block was drafted remotely)."""
        n = max(self.blocks, 1)
        return FlowStats(
            remote_blocks=self.blocks, f1_bytes_per_block=self.f1_bytes / n,
            f2_bytes_per_block=self.f2_bytes / n, f3_bytes_per_block=self.f3_bytes / n,
            f1_ms_per_block=self.f1_ms / n, f2_ms_per_block=self.f2_ms / n,
            f3_ms_per_block=self.f3_ms / n, proposer_compute_ms_per_block=self.compute_ms / n,
            predraft_hit_rate=self.predraft_hits / n, f3_probe=f3_probe)


def connect(endpoint: str, key: bytes | None) -> Client:
    """A client to a proposer agent, one that notices the peer's death at once."""
    return Client(endpoint, key=key, connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S, watch_peer=True)


class RemoteProposer(Proposer):
    def __init__(self, endpoint: str, *, key: bytes | None, proposer: str, model: str,
                 cross_round: bool = True, draft_timeout_s: float = DEFAULT_DRAFT_TIMEOUT_S,
                 open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S,
                 f3_probe_width: int = 0, features=None, f3_codec: str = "float16") -> None:
        """f3_probe_width > 0: before each draft request, send hidden-state-sized float16 rows
        and wait for the ack (F3 measured for real, labelled a probe)."""
        self.endpoint = endpoint
        self.key = key
        self.spec = proposer
        # a dynamic-tree drafter on the other end: the loop gives it the node budget
        self.drafts_trees = drafts_tree(proposer)
        self.model = model
        self.cross_round = cross_round
        self.draft_timeout_s = draft_timeout_s
        self.open_timeout_s = open_timeout_s
        self.f3_probe_width = f3_probe_width
        self.features = features  # VerifierFeatures: real F3 for a hidden-state drafter
        self.wants_features = features is not None
        self.f3_codec = f3_codec
        self.name = f"{proposer}@{endpoint}"
        self._client: Client | None = None
        self._pending = ""
        self._pending_len = 0
        self._f3_bytes = 0
        self._sent_bytes = 0
        self._t0 = 0.0
        self._f3: tuple[int, float] = (0, 0.0)
        self._costs: dict[int, float] | None = None  # the verifier's verify(L), sent once
        self._opening_sid = ""
        self._open_len = 0  # context tokens the session opens with
        self._open_by = 0.0  # monotonic deadline of the open
        self.start(GREEDY)

    def start(self, params: SamplingParams = GREEDY) -> None:
        self.params = params
        self._session = ""
        self._sent = 0  # context tokens the remote session knows
        self._f_sent = 0  # feature rows the remote session has
        self._block = 0
        self.flows = FlowTotals()
        self._feedback: tuple[int, int, float] = (-1, 0, 0.0)  # for the next request
        self._opening = ""  # the id of an OpenSession in flight (`_opened` collects it)
        self._asked = False  # this block's request went out (`begin`): `finish` collects it

    def seed_verify_costs(self, costs) -> None:
        self._costs = {int(k): float(v) for k, v in costs.items()}

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        """Kept for the next request: the drafter on the other Mac learns from it."""
        self._feedback = (int(accepted), int(verified or drafted + 1), float(verify_ms))

    def _open(self, context: Sequence[int]) -> None:
        """Send OpenSession without waiting for it: a proposer agent that must load a model
        first does not hold up the verifier (`_opened` collects the answer)."""
        self._client = self._client or connect(self.endpoint, self.key)
        self._opening_sid = uuid.uuid4().hex[:16]
        msg = OpenSession(session_id=self._opening_sid, proposer=self.spec, model=self.model,
                          prompt=[int(t) for t in context], temperature=self.params.temperature,
                          top_p=self.params.top_p, seed=self.params.seed,
                          cross_round=self.cross_round)
        try:
            self._opening = self._client.send(msg)
        except PeerUnavailable as e:
            raise ProposerFailed(f"cannot open a drafting session on {self.endpoint}: {e}") from e
        self._open_len = len(context)
        self._open_by = time.monotonic() + self.open_timeout_s

    def _opened(self, wait_s: float) -> bool:
        """Whether the session is open, collecting OpenSession's answer if it came within
        `wait_s`. ProposerFailed when it was refused, or not answered by the open deadline."""
        until = time.monotonic() + wait_s
        while True:
            try:
                env = self._client.recv(max(0.0, until - time.monotonic()))
            except TransportTimeout:
                if time.monotonic() < self._open_by:
                    return False
                self._opening = ""
                self._client.reset()
                raise ProposerFailed(f"cannot open a drafting session on {self.endpoint}: no "
                                     f"answer within {self.open_timeout_s:.0f} s") from None
            except (ProtocolError, PeerUnavailable) as e:
                raise ProposerFailed(f"cannot open a drafting session on {self.endpoint}: "
                                     f"{e}") from e
            if env.header.reply_to == self._opening:
                break  # anything else is a stray answer to an earlier request
        reply, self._opening = env.msg, ""
        if isinstance(reply, ErrorReply):
            raise ProposerFailed(f"cannot open a drafting session on {self.endpoint}: "
                                 f"{reply.code}: {reply.message}")
        if not isinstance(reply, SessionOpened):
            raise ProposerFailed(f"{self.endpoint} answered {type(reply).__name__} to OpenSession")
        self.name = f"{reply.proposer}@{self.endpoint}"
        self._session, self._sent, self._f_sent = self._opening_sid, self._open_len, 0
        return True

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self.begin(context, k)
        return self.finish()

    def begin(self, context: Sequence[int], k: int) -> None:
        """Send the draft request (F1) without waiting, so a tree's proposers draft at once;
        until the session is open nothing goes out and `finish` gives an empty draft."""
        if not self._session:
            wait = 0.0 if self._opening else OPEN_GRACE_S
            if not self._opening:
                self._open(context)
            if not self._opened(wait):
                self._asked = False
                return
        self._asked = True
        assert self._client is not None
        delta = [int(t) for t in context[self._sent:]]
        self._block += 1
        self._f3 = self._f3_probe(len(delta)) if self.f3_probe_width else (0, 0.0)
        feats, f_start = self._new_features(len(context))
        scale = None
        if feats is not None and self.f3_codec == "int8":
            from macfleet.engine.proposers.eagle.f3codec import encode_int8

            feats, scale = encode_int8(feats)
        acc, verified, vms = self._feedback
        costs, self._costs = self._costs, None
        req = DraftRequest(session_id=self._session, block=self._block, committed=delta, k=k,
                           want_probs=not self.params.greedy, features=feats,
                           features_start=f_start, features_scale=scale,
                           last_accepted=acc, last_verified=verified, last_verify_ms=vms,
                           verify_lengths=sorted(costs) if costs else None,
                           verify_costs_ms=[costs[L] for L in sorted(costs)] if costs else None)
        self._feedback = (-1, 0, 0.0)
        self._f3_bytes = 0 if feats is None else int(feats.nbytes) + (
            0 if scale is None else int(scale.nbytes))
        self._t0 = time.perf_counter()
        try:
            self._pending = self._client.send(req, session=self._session)
        except PeerUnavailable as e:
            raise ProposerFailed(f"{self.endpoint}: {e}") from e
        self._pending_len = len(context)
        self._sent_bytes = self._client.last_sent_bytes

    def finish(self) -> Draft:
        """Collect the reply (F2) of the request sent by `begin` (empty: none went out)."""
        if not self._asked:
            return Draft((), None, 0.0)
        self._asked = False
        assert self._client is not None
        deadline = self._t0 + self.draft_timeout_s
        try:
            while True:
                env = self._client.recv(max(0.0, deadline - time.perf_counter()))
                if env.header.reply_to == self._pending:
                    break
        except (ProtocolError, TransportTimeout, PeerUnavailable) as e:
            self._client.reset()
            raise ProposerFailed(f"{self.endpoint}: {e}") from e
        reply = env.msg
        rtt_ms = (time.perf_counter() - self._t0) * 1e3
        if isinstance(reply, ErrorReply):
            raise ProposerFailed(f"{self.endpoint}: {reply.code}: {reply.message}")
        if not isinstance(reply, DraftReply) or reply.block != self._block:
            raise ProposerFailed(f"{self.endpoint} sent an unexpected reply to block {self._block}")
        self._sent = self._pending_len
        wire = max(0.0, rtt_ms - reply.draft_ms)
        b3, f3_ms = self._f3
        if self._f3_bytes:  # real F3 rode with F1: split the round trip's wire time by bytes
            b1, b2 = self._sent_bytes - self._f3_bytes, self._client.last_recv_bytes
            f3_ms = wire * self._f3_bytes / (b1 + b2 + self._f3_bytes)
            b3, wire = self._f3_bytes, wire - f3_ms
            self._f_sent = self._pending_len - 1
        else:
            b1 = self._sent_bytes
        self.flows.add(b1, self._client.last_recv_bytes, wire, reply.draft_ms,
                       reply.predraft_hit, b3, f3_ms)
        parents = tuple(reply.parents) if reply.parents is not None else None
        return Draft(tuple(reply.tokens), reply.probs, rtt_ms, parents)

    def feature_rows(self, n: int):
        """The hidden rows 0..n-1 its session was fed ([n, H]), None unless it holds them all
        (a batching verifier copies them with a shared prompt prefix)."""
        return None if self.features is None else self.features.feature_rows(n)

    def feed_features(self, start: int, tokens, hidden) -> None:
        """Rows of this session's batched forward, to send on over F3 (a tapped verifier's
        features need no feeding)."""
        self.features.feed(start, tokens, hidden)

    def _new_features(self, context_len: int):
        """Rows the remote drafter lacks: positions _f_sent .. context_len - 2."""
        if self.features is None:
            return None, 0
        rows = self.features.rows(self._f_sent, context_len - 1)
        return (rows, self._f_sent) if rows is not None else (None, 0)

    def _f3_probe(self, n_tokens: int) -> tuple[int, float]:
        states = np.zeros((max(n_tokens, 1), self.f3_probe_width), dtype=np.float16)
        msg = HiddenStates(self._session, self._block, list(range(len(states))), states)
        t0 = time.perf_counter()
        try:
            ack = self._client.request(msg, timeout=self.draft_timeout_s, session=self._session)
        except (ProtocolError, TransportTimeout, PeerUnavailable) as e:
            raise ProposerFailed(f"{self.endpoint} (F3 probe): {e}") from e
        if not isinstance(ack, HiddenStatesAck):
            raise ProposerFailed(f"{self.endpoint} answered {type(ack).__name__} to HiddenStates")
        return self._client.last_sent_bytes, (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        if self._client is not None:
            if self._session:
                try:
                    self._client.request(CloseSession(self._session), timeout=1.0)
                except (ProtocolError, TransportTimeout, PeerUnavailable):
                    pass  # the proposer evicts idle sessions by itself
            self._client.close()
            self._client = None
        self._session = ""

    def flow_stats(self) -> FlowStats:
        return self.flows.summary(f3_probe=bool(self.f3_probe_width))
