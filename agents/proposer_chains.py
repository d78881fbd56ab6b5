"""EAGLE chain sessions of one round, drafted together on the proposer agent.

A batching verifier asks for every session's block at once. The proposer's compute thread
takes the other chain sessions' requests of the round off its queue (`gather`, for at most
`GATHER_S`), brings each session up to date alone (a bad request is answered with its error),
then drafts them in one `draft_chains` call per head: one head forward per draft position for
all of them (their head caches are rows of one store), not one session after the other while
the verifier waits for the last. `ChainRounds` is a part of `ProposerService`
(agents/proposer_service.py): it reads the service's sessions, job queue and the jobs held
back while gathering (`_sessions`, `_jobs`, `_pending`), its `_update`, `_answer` and its
counters.
"""

from __future__ import annotations

import logging
import queue
import time

import numpy as np

from bridge.errors import INTERNAL
from bridge.messages import DraftReply, DraftRequest, ErrorReply
from macfleet.engine.proposers.eagle.chain import draft_chains

log = logging.getLogger(__name__)

# a chain request waits at most this long for the other chain sessions' requests of its round
# (a batching verifier sends them back to back; a verifier of one session never waits: there
# is no other session to wait for)
GATHER_S = 0.004


class ChainRounds:
    """The proposer's chain rounds: see the module docstring."""

    def _chained(self, msg) -> bool:
        """A draft request of a session whose chains are drafted with the others'."""
        s = self._sessions.get(msg.session_id) if isinstance(msg, DraftRequest) else None
        return s is not None and getattr(s.proposer, "rows", None) is not None

    def _gather(self, first: str) -> list:
        """The other chain sessions' requests of this round: taken off the queue until every
        open chain session has one here or `GATHER_S` has passed; other jobs keep their order
        for after."""
        want = {sid for sid, s in self._sessions.items()
                if getattr(s.proposer, "rows", None) is not None} - {first}
        got, seen = [], {first}
        deadline = time.perf_counter() + GATHER_S
        while want - seen:
            left = deadline - time.perf_counter()
            try:
                job = self._jobs.get(timeout=left) if left > 0 else self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and self._chained(job[0]) and job[0].session_id not in seen:
                got.append(job)
                seen.add(job[0].session_id)
            else:
                self._pending.append(job)
                if job is None:
                    break
        return got

    def _serve_together(self, jobs: list) -> None:
        """Chain requests of several sessions: each validated and brought up to date alone (a
        bad one is answered with its error, as a request served alone), then all drafted in one
        `draft_chains` call."""
        ready = []
        for msg, reply, received in jobs:
            self._answer(reply, lambda: ready.append(
                (msg, reply, received, self._update(msg, getattr(reply, "peer", b"")))))
        if not ready:
            return
        groups: dict[int, list] = {}  # one draft_chains call per head (its store of rows)
        for item in ready:
            groups.setdefault(id(item[3].proposer.rows), []).append(item)
        for group in groups.values():
            self._draft_group(group)

    def _draft_group(self, group: list) -> None:
        t0 = time.perf_counter()
        try:
            drafts = draft_chains([(s.proposer, s.context, msg.k) for msg, _, _, s in group])
        except Exception as e:  # noqa: BLE001 - every session of the call gets the error
            log.exception("drafting chains together failed")
            for _, reply, _, _ in group:
                reply(ErrorReply(INTERNAL, f"{type(e).__name__}: {e}"))
            return
        ms = (time.perf_counter() - t0) * 1e3
        if len(group) > 1:
            self.drafted_together += len(group)
        for (msg, reply, received, s), d in zip(group, drafts):
            s.last_k, s.last_used = msg.k, time.monotonic()
            self.served += 1
            if self._on_block:
                self._on_block(msg.session_id, msg.block, ms / len(group), False)
            reply(DraftReply(session_id=msg.session_id, block=msg.block, tokens=list(d.tokens),
                             probs=None if d.probs is None else d.probs.astype(np.float32),
                             draft_ms=(time.perf_counter() - received) * 1e3,
                             predraft_hit=False))
