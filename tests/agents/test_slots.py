"""agents.proposer_service.slot_for: who gets a drafting session when slots run out (pure)."""

from __future__ import annotations

from agents.proposer_service import ProposerLimits, slot_for

LIMITS = ProposerLimits(max_sessions=4, max_sessions_per_client=3, reclaim_idle_s=3.0)


def test_below_the_total_a_client_gets_a_slot_up_to_its_cap():
    assert slot_for(b"a", {}, {}, 0.0, LIMITS).ok
    owners = {"1": b"a", "2": b"a", "3": b"a"}
    s = slot_for(b"a", owners, dict.fromkeys(owners, 0.0), 1.0, LIMITS)
    assert not s.ok and "per client" in s.why


def test_when_full_the_longest_idle_session_gives_way():
    owners = {"1": b"a", "2": b"b", "3": b"c", "4": b"d"}
    used = {"1": 9.0, "2": 7.5, "3": 9.5, "4": 9.9}
    assert slot_for(b"e", owners, used, 10.0, LIMITS).evict is None  # none idle 3 s: ...
    assert not slot_for(b"e", owners, used, 10.0, LIMITS).ok  # ... and nobody holds more
    assert slot_for(b"e", owners, used, 7.5 + 3.0, LIMITS).evict == "2"


def test_when_full_and_busy_the_biggest_holder_gives_way_to_a_smaller_one():
    owners = {"1": b"a", "2": b"a", "3": b"a", "4": b"b"}
    used = {"1": 9.9, "2": 9.5, "3": 9.8, "4": 9.0}
    s = slot_for(b"v", owners, used, 10.0, LIMITS)
    assert s.ok and s.evict == "2"  # a's least recently used, not b's older one
    # the holder cannot win its slot back from the newcomer: 2 + 1 is not below 1 + 1 ...
    owners2 = {"1": b"a", "3": b"a", "4": b"b", "5": b"v"}
    assert not slot_for(b"a", owners2, {**used, "5": 10.0}, 10.1, LIMITS).ok
    # ... nor can b, holding one as v does
    assert not slot_for(b"b", owners2, {**used, "5": 10.0}, 10.1, LIMITS).ok
