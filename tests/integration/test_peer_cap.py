"""A live agent caps the pending connections one address holds on each of its ports (ROUTER
and the metrics PUB): over the cap the oldest raw TCP connections are closed at once, a key
holder is still served, and the counts go back to zero once the connections close."""

from __future__ import annotations

import socket
import time

import pytest

from bridge import peercap
from bridge.messages import Ping, Pong
from bridge.transport import Client

pytestmark = [pytest.mark.timeout(90)]

KEY = b"P" * 32
CAP = 8
EXTRA = 12


@pytest.fixture(scope="module")
def agent():
    from agents.daemon import Agent, AgentConfig

    a = Agent(AgentConfig(role="proposer", model="tiny:1", key=KEY, advertise=False,
                          max_conns_per_peer=CAP))
    yield a
    a.close()


def flood(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def closed_by_peer(conns: list[socket.socket], within_s: float) -> int:
    deadline = time.monotonic() + within_s
    closed = 0
    for s in conns:
        try:
            while True:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                if not s.recv(4096):
                    closed += 1
                    break
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
    return closed


def settles(guard, want: dict, timeout: float = 8.0) -> bool:
    deadline = time.monotonic() + timeout
    while guard.counts() != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return guard.counts() == want


def test_the_agent_caps_both_its_ports_as_configured(agent):
    """The fast lane's check of this file: the agent hands its cap to both shells' guards (the
    guards' dropping over the cap and serving key holders: bridge/test_peercap.py's router and
    publisher floods); the live floods below run in the default suite."""
    for shell in (agent.server, agent.publisher):
        assert shell.peers is not None and shell.peers.table.cap == CAP


@pytest.mark.slow  # a flood past the handshake's time, then a window for the closes: seconds
@pytest.mark.parametrize("port", ["router", "pub"])
def test_extra_connections_are_dropped_and_key_holders_served(agent, port):
    shell = agent.server if port == "router" else agent.publisher
    assert settles(shell.peers, {})
    with Client(agent.card.router_endpoint, key=KEY) as c:
        assert isinstance(c.request(Ping(1, 0), 5), Pong)
        taken = 1 if port == "router" else 0  # the key holder's own connection
        conns = flood(shell.port, EXTRA)
        time.sleep(peercap.DEFAULT_MIN_LIFE_S + 0.2)  # past their handshake's time
        conns += flood(shell.port, CAP)
        try:
            # the oldest give way at once, well before CURVE's 3 s handshake deadline; the
            # key holder's authenticated connection never does
            assert closed_by_peer(conns, 1.5) == EXTRA
            assert shell.peers.pending_counts() == {"127.0.0.1": CAP}
            assert shell.peers.counts() == {"127.0.0.1": CAP + taken}
            assert isinstance(c.request(Ping(2, 0), 5), Pong)  # its connection was kept
        finally:
            for s in conns:
                s.close()
        assert settles(shell.peers, {"127.0.0.1": taken} if taken else {})
    assert settles(shell.peers, {})  # nothing leaks
    assert shell.peers.dropped()["127.0.0.1"] >= EXTRA


def test_the_default_cap_is_generous():
    from bridge import peercap

    assert peercap.DEFAULT_MAX_PER_PEER >= 64
