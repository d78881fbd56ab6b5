"""Chain sessions of one round, drafted together on the proposer agent.

A batching verifier asks for every session's block at once: the compute thread gathers the
other chain sessions' requests of the round (`GATHER_S` at most), brings each session up to
date alone, then drafts them in one `draft_together` call per model (docs/agents.md,
"proposer_chains.py"). `ProposerService` hands `ChainRounds` its sessions, job queue and the
`update`, `answer` and `drafted` steps.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from bridge.errors import INTERNAL
from bridge.messages import DraftRequest, ErrorReply
from macfleet.engine.proposers.base import draft_together

log = logging.getLogger(__name__)

# a chain request waits at most this long for the other chain sessions' requests of its round
GATHER_S = 0.004


class ChainRounds:
    """The proposer's chain rounds: see the module docstring."""

    def __init__(self, sessions: dict, jobs: queue.SimpleQueue, *, update: Callable,
                 answer: Callable, drafted: Callable) -> None:
        self.sessions, self.jobs = sessions, jobs
        self.update, self.answer, self.drafted = update, answer, drafted
        self.held: deque = deque()  # jobs taken off the queue while gathering, served after

    def chained(self, msg) -> bool:
        """A draft request of a session whose chains are drafted with the others'."""
        s = self.sessions.get(msg.session_id) if isinstance(msg, DraftRequest) else None
        return s is not None and s.proposer.rows is not None

    def serve(self, job) -> None:
        """A chained request's round: it and the other chain sessions' requests gathered."""
        self._serve_together([job, *self._gather(job[0].session_id)])

    def _gather(self, first: str) -> list:
        """The other chain sessions' requests of this round, taken off the queue for at most
        `GATHER_S`; other jobs keep their order for after (`held`)."""
        want = {sid for sid, s in self.sessions.items()
                if s.proposer.rows is not None} - {first}
        got, seen = [], {first}
        deadline = time.perf_counter() + GATHER_S
        while want - seen:
            left = deadline - time.perf_counter()
            try:
                job = self.jobs.get(timeout=left) if left > 0 else self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and self.chained(job[0]) and job[0].session_id not in seen:
                got.append(job)
                seen.add(job[0].session_id)
            else:
                self.held.append(job)
                if job is None:
                    break
        return got

    def _serve_together(self, jobs: list) -> None:
        """Chain requests of several sessions: each brought up to date alone (a bad one gets its
        error), then drafted in one `draft_together` call per model."""
        ready = []
        for msg, reply, received in jobs:
            self.answer(reply, lambda: ready.append(
                (msg, reply, received, self.update(msg, getattr(reply, "peer", b"")))))
        groups: dict[int, list] = {}
        for item in ready:
            groups.setdefault(id(item[3].proposer.rows), []).append(item)
        for group in groups.values():
            self._draft_group(group)

    def _draft_group(self, group: list) -> None:
        try:
            drafts = draft_together([(s.proposer, s.context, msg.k) for msg, _, _, s in group])
        except Exception as e:  # noqa: BLE001 - every session of the call gets the error
            log.exception("drafting chains together failed")
            for _, reply, _, _ in group:
                reply(ErrorReply(INTERNAL, f"{type(e).__name__}: {e}"))
            return
        for (msg, reply, received, s), d in zip(group, drafts):
            s.last_k, s.last_used = msg.k, time.monotonic()
            reply(self.drafted(msg, received, d.tokens,
                               None if d.probs is None else d.probs.astype(np.float32), False))
