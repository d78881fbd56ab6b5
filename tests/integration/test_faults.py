"""Faults on a real local fleet: a verifier killed mid-generation, an agent asleep (SIGSTOP).

Agents are real processes (`macfleet.fleet.local.up`) serving the tiny random-weight model, so
start-up and generation are fast; the behaviour under test is the transport's, not the model's.
The proposer killed mid-generation is covered in test_fleet_processes.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import GenerateChunk, GenerateDone
from fleetkit import local_fleet
from macfleet.fleet.client import generate_remote, probe

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(180)]

MODEL = "tiny:1"
SILENCE_S = 3.0  # macfleet.fleet.client.DEFAULT_SILENCE_S: verifier heartbeats each second


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with local_fleet(tmp_path_factory.mktemp("faults"), model=MODEL) as f:
        yield f


def test_sigstopped_agent_is_reported_dead_then_rejoins(fleet):
    """A Mac asleep: heartbeats fail (FleetObserver shows it dead, probe says not alive); after
    SIGCONT it answers again and is seen alive, with no restart."""
    from macfleet.fleet.observer import FleetObserver

    card, pid = fleet["proposer"], fleet["agents"][ROLE_PROPOSER].pid

    def host(obs, want_alive, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = obs.poll(0.5)
            if snap is None:
                continue
            h = next((h for h in snap.hosts if h.node_id == card.node_id), None)
            if h is not None and h.alive == want_alive and (not want_alive or h.rtt_ms is not None):
                return snap
        pytest.fail(f"{card.name} not seen {'alive' if want_alive else 'dead'} in {timeout}s")

    obs = FleetObserver(fleet["key"], loopback=True, period_s=0.3, deadline_s=1.0,
                        ping_timeout_s=0.3)
    try:
        host(obs, True, 20)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            snap = host(obs, False, 10)
            assert time.monotonic() - t0 < 5.0  # deadline 1 s + a period or two
            assert any(e.kind == "heartbeat_lost" for e in snap.events)
            st = probe(card, fleet["key"], pings=1, timeout=0.5)
            assert not st.alive and st.error
        finally:
            os.kill(pid, signal.SIGCONT)
        snap = host(obs, True, 15)
        assert any(e.kind == "heartbeat_back" for e in snap.events)
        assert probe(card, fleet["key"], pings=2, timeout=2.0).alive
    finally:
        obs.close()


def test_zz_verifier_killed_mid_generation_gives_a_clear_error_not_a_hang(fleet):
    """SIGKILL the verifier after the first streamed tokens: the client's stream raises within
    3 s of the verifier's last message (heartbeats), with the default deadlines (the 120 s
    first-token deadline is not applied to every message), never hangs."""
    pid = fleet["agents"][ROLE_VERIFIER].pid
    got, killed = 0, None
    with pytest.raises((TransportTimeout, PeerUnavailable, ProtocolError)) as e:
        for msg in generate_remote(fleet["verifier"], fleet["key"], prompt="the cat sat on",
                                   chat=False, max_tokens=4096,
                                   proposers=[fleet["proposer"].router_endpoint],
                                   proposer_spec="ngram"):
            if isinstance(msg, GenerateChunk):
                got += len(msg.token_ids)
                if killed is None:
                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
            elif isinstance(msg, GenerateDone):
                pytest.fail("generation finished although its verifier was killed")
    assert killed is not None and got > 0
    waited = time.monotonic() - killed
    # chunks already in flight may still arrive; then one deadline, plus slack for a busy CPU
    assert waited < SILENCE_S + 2.0, waited
    assert "deadline" in str(e.value) or isinstance(e.value, (PeerUnavailable, ProtocolError))
    # the proposer is unaffected
    assert probe(fleet["proposer"], fleet["key"], pings=1).alive
