"""Connections per peer address: the pure table, then ROUTER and PUB shells with real TCP
connections (raw floods over the cap closed at once, key holders still served, counts back to
zero once the connections close)."""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from bridge import peercap
from bridge.errors import PeerUnavailable
from bridge.messages import Ping, Pong
from bridge.peercap import PeerTable, _live_fds
from bridge.transport import Client, Publisher, Server

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
CAP = 4
OTHER_ADDRESS = "127.0.0.2"  # Linux routes all of 127/8 to lo: a second peer address


# --- the pure table ---------------------------------------------------------------------------


def test_table_keeps_up_to_the_cap_per_address():
    t = PeerTable(2)
    assert [t.accepted(fd, "a") for fd in (10, 11, 12, 13)] == [True, True, False, False]
    assert t.accepted(14, "b") and t.count("a") == 2 and t.count("b") == 1
    assert t.dropped == {"a": 2} and t.total == 3
    t.closed(10)
    assert t.count("a") == 1 and t.accepted(15, "a")  # a slot freed is a slot to take
    for fd in (11, 12, 13, 14, 15, 99):  # closes of dropped or unknown fds change nothing
        t.closed(fd)
    assert t.counts() == {} and t.total == 0


def test_table_reused_fd_replaces_instead_of_counting_twice():
    t = PeerTable(8)
    t.accepted(7, "a")
    t.accepted(7, "b")  # fd 7 closed and reused before its close was seen
    assert t.counts() == {"b": 1}
    t.closed(7)
    assert t.counts() == {}


def test_table_cap_zero_is_no_cap_and_negative_is_refused():
    t = PeerTable(0)
    assert all(t.accepted(fd, "a") for fd in range(1000)) and t.count("a") == 1000
    with pytest.raises(ValueError):
        PeerTable(-1)


def test_an_accept_closed_later_in_the_same_batch_is_not_touched():
    A, D = zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED
    events = [(A, 5, "e"), (A, 6, "e"), (D, 5, "e"), (A, 5, "e")]
    assert _live_fds(events) == [False, True, True, True]


# --- the shells, with real connections ------------------------------------------------------


def echo(env, reply):
    reply(Pong(getattr(env.msg, "seq", 0), 0, "echo"))


def flood(port: int, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
            for _ in range(n)]


def closed_by_peer(conns: list[socket.socket], within_s: float) -> int:
    """How many of conns the server closed within `within_s` (the rest stay open)."""
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


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def other_address_usable() -> bool:
    try:
        with socket.socket() as s:
            s.bind((OTHER_ADDRESS, 0))
        return True
    except OSError:
        return False


def test_router_drops_connections_over_the_cap_and_serves_key_holders():
    with Server(echo, key=KEY, max_per_peer=CAP) as srv:
        with Client(srv.endpoint, key=KEY) as first:  # holds one of 127.0.0.1's slots
            assert first.request(Ping(1, 0), 5).seq == 1
            conns = flood(srv.port, CAP + 6)
            try:
                assert closed_by_peer(conns, 1.5) == 7  # CAP - 1 kept (first holds one)
                assert srv.peers.counts() == {"127.0.0.1": CAP}
                assert srv.peers.dropped()["127.0.0.1"] >= 7
                assert first.request(Ping(2, 0), 5).seq == 2  # its connection was kept
                if other_address_usable():
                    other = f"tcp://{OTHER_ADDRESS}:0;127.0.0.1:{srv.port}"
                    with Client(other, key=KEY) as c:  # another address has its own slots
                        assert c.request(Ping(3, 0), 5).seq == 3
                        assert srv.peers.counts()[OTHER_ADDRESS] == 1
            finally:
                for s in conns:
                    s.close()
            assert wait_for(lambda: srv.peers.counts() == {"127.0.0.1": 1}), srv.peers.counts()
        assert wait_for(lambda: srv.peers.counts() == {})


def test_publisher_drops_connections_over_the_cap():
    with Publisher(key=KEY, max_per_peer=CAP) as pub:
        conns = flood(pub.port, CAP + 3)
        try:
            assert closed_by_peer(conns, 1.5) == 3
            assert pub.peers.counts() == {"127.0.0.1": CAP}
        finally:
            for s in conns:
                s.close()
        assert wait_for(lambda: pub.peers.counts() == {})


def test_the_default_cap_is_patchable_and_zero_turns_it_off(monkeypatch):
    monkeypatch.setattr(peercap, "DEFAULT_MAX_PER_PEER", 2)
    with Server(echo, key=KEY) as srv:
        assert srv.peers.table.cap == 2
    with Server(echo, key=KEY, max_per_peer=0) as srv:
        assert srv.peers is None
        conns = flood(srv.port, 8)
        try:
            assert closed_by_peer(conns, 0.5) == 0
        finally:
            for s in conns:
                s.close()


def test_the_guard_ends_with_its_socket_and_never_stalls_the_context():
    """libzmq blocks the thread emitting a monitor event while nobody reads the monitor: a
    guard gone before its socket's last event stalled every later close in the context (a
    closed Client kept its TCP connection; a server's close went unseen by its clients)."""
    for _ in range(3):
        srv = Server(echo, key=KEY, max_per_peer=CAP).start()
        with Client(srv.endpoint, key=KEY) as c:
            assert c.request(Ping(1, 0), 5).seq == 1
        srv.close()
        assert srv.peers.join(2.0)
        Server(echo, key=KEY, max_per_peer=CAP).close()  # never started
        pub = Publisher(key=KEY, max_per_peer=CAP)
        pub.close()
        assert pub.peers.join(2.0)
    srv = Server(lambda env, reply: None, key=KEY, poll_s=0.02).start()  # never answers
    with Client(srv.endpoint, key=KEY, watch_peer=True) as c:
        c.send(Ping(1, 0))
        time.sleep(0.2)
        srv.close()
        with pytest.raises(PeerUnavailable, match="lost"):
            c.recv(3.0)
