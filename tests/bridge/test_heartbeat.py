"""Heartbeats: the pure table under a fake clock, then the thread over real ZeroMQ on loopback."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from bridge.heartbeat import EMPTY_RTT, Heartbeat, HeartReport, HeartTable, PeerState

MS = 1_000_000  # ns
DEADLINE_S = 0.25
DEADLINE = int(DEADLINE_S * 1000) * MS


def partition(report: HeartReport) -> list[frozenset]:
    return [report.new, report.good, report.failed, report.down, report.waiting]


def assert_partition(report: HeartReport, peers: set) -> None:
    parts = partition(report)
    assert set().union(*parts) == peers
    assert sum(len(p) for p in parts) == len(peers)  # each peer in exactly one set
    assert report.recovered <= report.new


# -- pure core -------------------------------------------------------------------------------
def test_new_good_failed_down() -> None:
    table = HeartTable(DEADLINE_S, window=8)
    table.beat_sent("a", 1, 0)
    table.beat_sent("b", 2, 0)
    assert table.pong("a", 1, 0, 2 * MS)
    r = table.tick(50 * MS)
    assert (r.new, r.waiting) == ({"a"}, {"b"})
    assert_partition(r, {"a", "b"})
    table.beat_sent("a", 3, 50 * MS)
    assert table.pong("a", 3, 50 * MS, 51 * MS)
    r = table.tick(100 * MS)
    assert (r.good, r.waiting) == ({"a"}, {"b"})
    r = table.tick(251 * MS)  # b silent since it was added at 0: past the deadline
    assert (r.good, r.failed) == ({"a"}, {"b"})
    assert table.state("b") is PeerState.FAILED and table.generation("b") == 1
    r = table.tick(400 * MS)  # a's last pong at 51 ms is now too old; b stays down, not re-failed
    assert (r.failed, r.down) == ({"a"}, {"b"})
    assert_partition(r, {"a", "b"})


def test_late_pong_from_failed_generation_does_not_revive() -> None:
    table = HeartTable(DEADLINE_S, window=8)
    table.beat_sent("a", 1, 0)
    table.pong("a", 1, 0, 1 * MS)
    table.tick(10 * MS)
    table.beat_sent("a", 2, 100 * MS)  # this one is never answered in time
    r = table.tick(300 * MS)
    assert r.failed == {"a"}
    assert not table.pong("a", 2, 100 * MS, 310 * MS)  # answers generation 0: ignored
    r = table.tick(320 * MS)
    assert r.down == {"a"} and not r.new
    table.beat_sent("a", 3, 320 * MS)  # a ping of the new generation
    assert table.pong("a", 3, 320 * MS, 321 * MS)
    r = table.tick(330 * MS)
    assert r.new == r.recovered == {"a"}
    assert table.state("a") is PeerState.ALIVE


def test_pong_rejects_what_was_not_asked() -> None:
    table = HeartTable(DEADLINE_S, window=8)
    table.beat_sent("a", 1, 0)
    assert not table.pong("zz", 1, 0, 1 * MS)  # unknown peer
    assert not table.pong("a", 9, 0, 1 * MS)  # unknown seq
    assert not table.pong("a", 1, 7, 1 * MS)  # forged timestamp (and the ping is consumed)
    table.beat_sent("a", 2, 0)
    assert table.pong("a", 2, 0, 1 * MS)
    assert not table.pong("a", 2, 0, 2 * MS)  # duplicate
    table.beat_sent("a", 3, 10 * MS)
    table.tick(300 * MS)  # prunes pings older than the deadline
    assert not table.pong("a", 3, 10 * MS, 301 * MS)


def test_rtt_sliding_window_percentiles() -> None:
    table = HeartTable(DEADLINE_S, window=4)
    assert table.rtt("a") is EMPTY_RTT and math.isnan(EMPTY_RTT.p50_ms)
    for seq, rtt_ms in enumerate([1, 2, 3, 4, 5, 6], start=1):
        table.beat_sent("a", seq, seq * 100 * MS)
        table.pong("a", seq, seq * 100 * MS, seq * 100 * MS + rtt_ms * MS)
    stats = table.rtt("a")
    assert (stats.p50_ms, stats.p95_ms, stats.last_ms, stats.n) == (4.0, 6.0, 6.0, 4)


def test_remove_and_bad_arguments() -> None:
    table = HeartTable(DEADLINE_S, window=4)
    table.add("a", 0)
    table.remove("a")
    table.remove("never")
    assert table.peers() == [] and table.tick(10**12) == HeartReport()
    with pytest.raises(ValueError):
        HeartTable(0, window=4)


# -- the shell over ZeroMQ ---------------------------------------------------------------------
class EchoPeer:
    """A ROUTER on loopback that echoes every message, in a thread that can stop and come back.
    While stopped the socket stays bound, so pings queue up and are echoed late on restart."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(2)
        assert not self._thread.is_alive()

    def close(self) -> None:
        self.sock.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(10):
                self.sock.send_multipart(self.sock.recv_multipart())


class Pinger:
    """The client side as the lead would wire it: one I/O thread owns the DEALERs; the
    heartbeat thread hands pings over an inproc PUSH/PULL, pongs go to Heartbeat.on_pong."""

    def __init__(self, ctx: zmq.Context, endpoints: dict[str, str]) -> None:
        self.hb: Heartbeat | None = None
        self.rejected = 0  # pongs the heartbeat did not count (stale, pruned)
        self._push = ctx.socket(zmq.PUSH)
        self._push.linger = 0
        self._pull = ctx.socket(zmq.PULL)
        self._pull.linger = 0
        self._pull.bind("inproc://pings")
        self._push.connect("inproc://pings")
        self._dealers: dict[str, zmq.Socket] = {}
        for peer, endpoint in endpoints.items():
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(endpoint)
            self._dealers[peer] = dealer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send_ping(self, peer: str, seq: int, sent_ns: int) -> None:  # heartbeat thread
        self._push.send_multipart([peer.encode(), b"%d" % seq, b"%d" % sent_ns], zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        by_socket = {}
        for peer, dealer in self._dealers.items():
            poller.register(dealer, zmq.POLLIN)
            by_socket[dealer] = peer
        while not self._stop.is_set():
            for sock, _ in poller.poll(10):
                if sock is self._pull:
                    peer, seq, sent = self._pull.recv_multipart()
                    self._dealers[peer.decode()].send_multipart([seq, sent], zmq.NOBLOCK)
                else:
                    seq, sent = sock.recv_multipart()
                    assert self.hb is not None
                    if not self.hb.on_pong(by_socket[sock], int(seq), int(sent)):
                        self.rejected += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for sock in (self._push, self._pull, *self._dealers.values()):
            sock.close(linger=0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str, float]] = []
        self.changed = threading.Condition(self.lock)

    def failed(self, peer: str) -> None:
        self._add("failed", peer)

    def recovered(self, peer: str) -> None:
        self._add("recovered", peer)

    def _add(self, kind: str, peer: str) -> None:
        with self.changed:
            self.events.append((kind, peer, time.monotonic()))
            self.changed.notify_all()

    def wait(self, kind: str, peer: str, timeout: float) -> float:
        with self.changed:
            ok = self.changed.wait_for(
                lambda: any(e[:2] == (kind, peer) for e in self.events), timeout)
            assert ok, f"no {kind} {peer} within {timeout} s; got {self.events}"
            return next(e[2] for e in self.events if e[:2] == (kind, peer))


@pytest.mark.timeout(20)
def test_heartbeat_over_zmq_fails_and_recovers(ctx: zmq.Context) -> None:
    period_s, deadline_s = 0.05, 0.4  # the deadline leaves room for RTT spikes on a busy box
    slack_s = 0.25  # thread scheduling on a loaded 2-core CI box
    a, b = EchoPeer(ctx), EchoPeer(ctx)
    a.start()
    b.start()
    pinger = Pinger(ctx, {"a": a.endpoint, "b": b.endpoint})
    rec = Recorder()
    hb = Heartbeat(pinger.send_ping, peers=["a", "b"], period_s=period_s, deadline_s=deadline_s,
                   window=16, on_failed=rec.failed, on_recovered=rec.recovered)
    pinger.hb = hb
    try:
        hb.start()
        deadline = time.monotonic() + 5
        while not (hb.state("a") is hb.state("b") is PeerState.ALIVE):
            assert time.monotonic() < deadline, hb.last_report
            time.sleep(period_s)
        while hb.rtt("a").n < 3:
            assert time.monotonic() < deadline
            time.sleep(period_s)
        stats = hb.rtt("a")
        assert 0 < stats.p50_ms <= stats.p95_ms < deadline_s * 1000, stats  # later = rejected

        stopped_at = time.monotonic()
        a.stop()
        failed_at = rec.wait("failed", "a", timeout=3)
        assert failed_at - stopped_at <= deadline_s + period_s + slack_s
        assert hb.state("b") is PeerState.ALIVE

        a.start()  # echoes the queued stale pings first: they must not count as recovery
        rec.wait("recovered", "a", timeout=3)
        assert hb.state("a") is PeerState.ALIVE
        assert [e[0] for e in rec.events if e[1] == "a"] == ["failed", "recovered"]
        assert pinger.rejected > 0  # the stale echoes were seen, and ignored
    finally:
        assert hb.stop()
        pinger.close()
        for peer in (a, b):
            peer.stop()
            peer.close()


@pytest.mark.timeout(10)
def test_callback_errors_do_not_stop_the_heartbeat_and_stop_has_a_deadline() -> None:
    calls: list[int] = []
    release = threading.Event()

    def send_ping(peer: str, seq: int, sent_ns: int) -> None:
        calls.append(seq)
        if len(calls) == 1:
            raise ConnectionError("socket gone")
        if len(calls) == 3:
            release.wait(5)  # a send that blocks: stop() must not hang on it

    hb = Heartbeat(send_ping, peers=["x"], period_s=0.01, deadline_s=1, join_timeout_s=0.1)
    hb.start()
    deadline = time.monotonic() + 3
    while len(calls) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert hb.stop() is False  # blocked in send_ping: reported, not hung
    release.set()
    assert hb.stop(timeout_s=2) is True
