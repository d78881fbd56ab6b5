"""Sessions' lives in the batching engine: queued, admitted, finished, failed or cancelled;
every ended session frees its KV, tells its caller, closes its drafters and stays a while among
the recently ended (the dashboard's short requests).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from macfleet.engine.events import Finished
from macfleet.fleet.batch import ServedSession
from macfleet.serve.batch_session import BatchSession, Overloaded, SessionFailed
from macfleet.serve.drafting import close_drafters
from macfleet.serve.session_kv import SessionKV
from macfleet.serve.timing import RECENT_SESSIONS
from macfleet.stats import PREDICTION, ProposerStats

log = logging.getLogger(__name__)


class Sessions:
    """The wait queue, the active sessions and the recently ended ones, under one lock `cv`
    (a condition on an RLock: the engine thread waits on it for work)."""

    def __init__(self, session_kv: SessionKV, clock: Callable[[], float], *, max_active: int,
                 max_queue: int) -> None:
        self.session_kv, self.clock = session_kv, clock
        self.max_active, self.max_queue = max_active, max_queue
        self.cv = threading.Condition()
        self.waiting: deque[BatchSession] = deque()
        self.active: list[BatchSession] = []
        self.ended: deque[ServedSession] = deque(maxlen=RECENT_SESSIONS)
        self._next_sid = 0

    def enqueue(self, build: Callable[[int], BatchSession]) -> BatchSession:
        """Queue the session `build(sid)` makes; Overloaded when the queue is full."""
        with self.cv:
            if len(self.waiting) >= self.max_queue:
                raise Overloaded(f"{len(self.waiting)} requests are already waiting")
            s = build(self._next_sid)
            self._next_sid += 1
            self.waiting.append(s)
            self.cv.notify()
        return s

    def load(self) -> tuple[int, int]:
        """(active sessions, waiting sessions)."""
        with self.cv:
            return len(self.active), len(self.waiting)

    def views(self) -> list[ServedSession]:
        """Active, then waiting, then recently ended sessions (newest first)."""
        with self.cv:
            live = [*self.active, *self.waiting]
            ended = list(self.ended)
        return [s.view() for s in live] + ended[::-1]

    def admit(self, start: Callable[[BatchSession], None]) -> None:
        """Under the lock: drop cancelled sessions, move waiting ones in while there is room;
        `start(s)` readies one (its cache, rng, drafters); one that cannot start fails alone."""
        self.active = [s for s in self.active if not self._drop_if_cancelled(s)]
        self.waiting = deque(s for s in self.waiting if not self._drop_if_cancelled(s))
        while self.waiting and len(self.active) < self.max_active:
            s = self.waiting.popleft()
            s.t_start = self.clock()
            if s.req.max_tokens == 0:
                self.finish(s, reason="length")
                continue
            try:
                start(s)
            except Exception as e:  # noqa: BLE001 - one bad session fails alone
                log.exception("session %d could not start", s.sid)
                self.finish(s, failed=f"could not start: {type(e).__name__}: {e}")
                continue
            self.active.append(s)

    def finish(self, s: BatchSession, *, reason: str = "", failed: str = "") -> None:
        """End a session: done (`reason`: stop | length), failed (`failed`: why) or
        cancelled (nobody is told)."""
        if s in self.active:
            self.active.remove(s)
        st = s.stats
        predicted = (ProposerStats(PREDICTION, st.prediction_drafted, st.prediction_accepted),)
        per_proposer = (*(s.group.per_proposer() if s.group is not None else ()),
                        *(predicted if s.prediction is not None else ()))
        chosen = (dict(drafters=s.group.drafter_stats(), choices=tuple(s.group.choices),
                       trace=tuple(s.group.trace))
                  if s.group is not None else {})
        self._release(s, "cancelled" if s.cancelled else "failed" if failed else "done")
        if s.cancelled:
            return
        if failed:
            s.emit(SessionFailed(failed))
            return
        stats = st.tally.stats(tokens=len(s.generated), elapsed_s=self.clock() - s.t_start,
                              prefill_ms=s.prefill_ms, proposer=s.proposer_name,
                              finish_reason=reason, per_proposer=per_proposer, **chosen)
        s.emit(Finished(stats, tuple(s.generated)))

    def shutdown(self, message: str) -> None:
        """Fail every session left (the engine is stopping)."""
        with self.cv:
            for s in [*self.active, *self.waiting]:
                self.finish(s, failed=message)

    def _drop_if_cancelled(self, s: BatchSession) -> bool:
        if s.cancelled:
            log.debug("session %d cancelled by its client", s.sid)
            self._release(s, "cancelled")
        return s.cancelled

    def _release(self, s: BatchSession, state: str) -> None:
        with self.cv:  # an RLock: some callers hold it already
            self.ended.append(s.view(state))
        self.session_kv.close(s, state == "done")
        if s.on_close is not None:
            s.on_close()
            s.on_close = None
        close_drafters(s)
