"""Sessions' lives (serve/lifecycle.py): the queue, admission, ends; no model."""

from __future__ import annotations

import pytest
from engine_parts_kit import Scripted, session

from macfleet.engine.events import Finished
from macfleet.engine.proposers.group import ProposerGroup
from macfleet.serve.batch_session import Overloaded, SessionFailed
from macfleet.serve.lifecycle import Sessions
from macfleet.serve.session_kv import SessionKV


def _sessions(max_active: int = 2, max_queue: int = 3) -> Sessions:
    now = iter(range(1000))
    clock = lambda: float(next(now))  # noqa: E731 - one second per reading
    return Sessions(SessionKV(None, None, None, clock), clock, max_active=max_active,
                    max_queue=max_queue)


def test_a_full_queue_refuses_and_sids_count_up():
    t = _sessions(max_queue=2)
    a = t.enqueue(lambda sid: session(sid))
    b = t.enqueue(lambda sid: session(sid))
    assert (a.sid, b.sid) == (0, 1) and t.load() == (0, 2)
    with pytest.raises(Overloaded):
        t.enqueue(lambda sid: session(sid))


def test_admission_fills_the_room_oldest_first_and_starts_each():
    t = _sessions(max_active=2)
    for _ in range(3):
        t.enqueue(lambda sid: session(sid))
    started = []
    t.admit(started.append)
    assert [s.sid for s in t.active] == [0, 1] == [s.sid for s in started]
    assert all(s.t_start is not None and s.context == [1, 2, 3] for s in started)
    assert t.load() == (2, 1)
    assert [v.state for v in t.views()] == ["prefill", "prefill", "queued"]


def test_one_that_cannot_start_fails_alone_and_a_zero_token_one_finishes_at_once():
    t = _sessions(max_active=4)
    bad = t.enqueue(lambda sid: session(sid, proposer=Scripted()))
    empty = t.enqueue(lambda sid: session(sid, max_tokens=0))
    good = t.enqueue(lambda sid: session(sid))

    def start(s):
        if s is bad:
            raise ValueError("no room")

    t.admit(start)
    assert t.active == [good]
    assert isinstance(bad.events[-1], SessionFailed) and "no room" in bad.events[-1].message
    assert bad.proposer is None  # its drafter closed
    assert isinstance(empty.events[-1], Finished) and empty.events[-1].token_ids == ()
    assert empty.events[-1].stats.finish_reason == "length"
    assert [v.state for v in t.views()][-2:] == ["done", "failed"]  # newest ended first


def test_a_finished_session_reports_its_statistics_and_closes_once():
    t = _sessions()
    closed = []
    s = t.enqueue(lambda sid: session(sid, on_close=lambda: closed.append(1)))
    t.admit(lambda s: None)
    s.generated = [5, 6, 7]
    s.stats.tally.record(2, 1, 1.0, 4.0)
    s.stats.tally.record(0, 0, 0.0, 4.0)
    t.finish(s, reason="stop")
    fin = s.events[-1]
    assert fin.token_ids == (5, 6, 7) and fin.stats.finish_reason == "stop"
    assert (fin.stats.blocks, fin.stats.drafted, fin.stats.accepted) == (2, 2, 1)
    assert fin.stats.elapsed_s > 0 and closed == [1] and t.load() == (0, 0)


def test_cancelled_sessions_leave_silently_waiting_or_active():
    t = _sessions(max_active=1)
    a = t.enqueue(lambda sid: session(sid))
    b = t.enqueue(lambda sid: session(sid))
    t.admit(lambda s: None)
    a.cancelled = b.cancelled = True
    t.admit(lambda s: pytest.fail("a cancelled session started"))
    assert t.load() == (0, 0) and a.events == [] and b.events == []
    assert [v.state for v in t.views()] == ["cancelled", "cancelled"]


def test_shutdown_fails_every_session_left():
    t = _sessions(max_active=1)
    ss = [t.enqueue(lambda sid: session(sid)) for _ in range(2)]
    t.admit(lambda s: None)
    t.shutdown("stopping")
    assert all(isinstance(s.events[-1], SessionFailed) for s in ss)


def test_a_session_cancelled_while_its_block_ran_ends_without_a_word():
    t = _sessions()
    s = t.enqueue(lambda sid: session(sid))
    t.admit(lambda s: None)
    s.cancelled = True  # the client left during the iteration that finished it
    t.finish(s, reason="length")
    assert s.events == [] and [v.state for v in t.views()] == ["cancelled"]


def test_an_ended_session_closes_every_drafter_it_has():
    t = _sessions()
    chain, members, prediction = Scripted(), [Scripted(), Scripted()], Scripted()
    s = t.enqueue(lambda sid: session(sid, proposer=chain, group=ProposerGroup(members),
                                      prediction=prediction))
    t.admit(lambda s: None)
    t.finish(s, reason="stop")
    assert all(p.closed for p in (chain, *members, prediction))
    assert (s.proposer, s.group, s.prediction) == (None, None, None)
