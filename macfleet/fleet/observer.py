"""The live fleet observer: Zeroconf + heartbeats + the agents' metric streams -> snapshots.

It is the dashboard's `SnapshotSource`. Liveness and RTT come from `bridge.heartbeat`'s
`Heartbeat` shell (a SIGKILLed agent keeps its Zeroconf card but stops answering, and is shown
dead): its thread schedules a ping per agent each period and hands it over a queue to this
observer's I/O thread, which owns the sockets: it browses for the fleet's agents, sends the
pings and feeds the pongs back, and asks their status now and then. A second thread subscribes
to their PUB sockets for BlockMetrics and AgentEvents. `poll()` hands out the newest snapshot.
Widgets never see a socket.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

from bridge.auth import fleet_id as fleet_id_of
from bridge.discovery import ALL_INTERFACES, LOOPBACK_ONLY, Browser, CardAdded, CardRemoved
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.heartbeat import Heartbeat, PeerState
from bridge.messages import (AgentEvent, BlockMetrics, Ping, Pong, StatusReply, StatusRequest)
from bridge.peers import signed
from bridge.transport import Client, Subscriber
from macfleet.fleet.metrics import SessionMetrics
from macfleet.fleet.snapshot import (FleetEvent, FleetSnapshot, HostView, LinkView,
                                     SessionView, SnapshotSource)

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 1.0
DEFAULT_PING_TIMEOUT_S = 0.5
DEFAULT_DEADLINE_S = 3.0
DEFAULT_STATUS_EVERY = 3
MAX_EVENTS = 200



def link_views(sessions: Sequence[SessionView]) -> tuple[LinkView, ...]:
    """Pure: one link per (verifier, proposers) pair, its wire times over every session that
    crossed it (p50, p95): two sessions on one pair are one link (the dashboard keys its rows
    by the pair)."""
    wires: dict[tuple[str, str], list[float]] = {}
    for s in sessions:
        pair = (s.verifier, ", ".join(s.proposers) or "proposer")
        wires.setdefault(pair, []).extend(b.wire_ms for b in s.timeline if b.wire_ms > 0)
    out = []
    for (src, dst), ms in wires.items():
        if ms:
            ms.sort()
            out.append(LinkView(src, dst, ms[len(ms) // 2],
                                ms[min(len(ms) - 1, int(len(ms) * 0.95))]))
    return tuple(out)

class FleetObserver(SnapshotSource):
    def __init__(self, key: bytes | None, *, loopback: bool = False,
                 period_s: float = DEFAULT_PERIOD_S, deadline_s: float = DEFAULT_DEADLINE_S,
                 ping_timeout_s: float = DEFAULT_PING_TIMEOUT_S) -> None:
        self.key = key
        self.fleet_id = fleet_id_of(key)
        self.period_s = period_s
        self.ping_timeout_s = ping_timeout_s
        self._lock = threading.Lock()
        self._events: deque[FleetEvent] = deque(maxlen=MAX_EVENTS)
        self._pings: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._hearts = Heartbeat(lambda *ping: self._pings.put(ping), period_s=period_s,
                                 deadline_s=deadline_s,
                                 on_failed=self._failed, on_recovered=self._recovered)
        self._cards: dict[str, object] = {}
        self._status: dict[str, StatusReply] = {}
        self._last_pong: dict[str, int] = {}
        self._clients: dict[str, Client] = {}
        self._sessions: dict[str, SessionMetrics] = {}
        self._stop = threading.Event()
        self._fresh = threading.Event()
        self._tick = 0
        self._sub = Subscriber(key=key)
        self._subscribed: set[str] = set()
        self._browser = Browser(fleet_id=self.fleet_id,
                                interfaces=LOOPBACK_ONLY if loopback else ALL_INTERFACES,
                                on_change=self._on_discovery,
                                accept=lambda c: signed(c, key))  # pinged: members only
        self._threads = [threading.Thread(target=self._io_loop, daemon=True, name="observe"),
                         threading.Thread(target=self._metrics_loop, daemon=True, name="metrics")]
        for t in self._threads:
            t.start()
        self._hearts.start()

    # -- discovery (zeroconf's thread: quick, no blocking calls)
    def _on_discovery(self, ev) -> None:
        if isinstance(ev, CardAdded):
            self._event("join", f"{ev.card.name} ({'/'.join(ev.card.roles)}) at "
                                f"{ev.card.router_endpoint}")
        elif isinstance(ev, CardRemoved):
            self._event("leave", f"{ev.card.name} said goodbye")

    def _event(self, kind: str, text: str) -> None:
        with self._lock:
            self._events.append(FleetEvent(time.time(), kind, text))
        self._fresh.set()

    # -- heartbeats and status (the I/O thread owns every Client)
    def _io_loop(self) -> None:
        next_browse = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_browse:
                self._browse()
                next_browse = time.monotonic() + self.period_s
            try:
                nid, seq, sent_ns = self._pings.get(timeout=min(0.1, self.period_s))
            except queue.Empty:
                continue
            card = self._cards.get(nid)
            stale = time.monotonic_ns() - sent_ns > self.period_s * 1e9  # a newer one is queued
            if card is not None and not stale:
                self._ping(nid, card, seq, sent_ns)

    def _browse(self) -> None:
        """Follow the discovered agents; ask their status every few periods."""
        self._tick += 1
        cards = {c.node_id: c for c in self._browser.cards()}
        with self._lock:
            gone = set(self._cards) - set(cards)
            self._cards = cards
        for nid in gone:  # said goodbye: no longer watched
            self._hearts.remove_peer(nid)
            client = self._clients.pop(nid, None)
            if client is not None:
                client.close()
        for nid, card in cards.items():
            self._subscribed.add(card.pub_endpoint)
            self._hearts.add_peer(nid)
            if self._tick % DEFAULT_STATUS_EVERY == 1:
                self._request_status(nid, card)
        self._fresh.set()

    def _failed(self, nid: str) -> None:  # heartbeat thread
        self._event("heartbeat_lost", f"{self._name(nid)} stopped answering heartbeats")

    def _recovered(self, nid: str) -> None:  # heartbeat thread
        self._event("heartbeat_back", f"{self._name(nid)} answers heartbeats again")

    def _name(self, nid: str) -> str:
        c = self._cards.get(nid)
        return c.name if c is not None else nid

    def _client(self, nid: str, card) -> Client:
        client = self._clients.get(nid)
        if client is None or client.endpoint != card.router_endpoint:
            client = self._clients[nid] = Client(card.router_endpoint, key=self.key,
                                                 connect_timeout_s=self.ping_timeout_s)
        return client

    def _ping(self, nid: str, card, seq: int, sent_ns: int) -> None:
        try:
            r = self._client(nid, card).request(Ping(seq, sent_ns), timeout=self.ping_timeout_s)
            if isinstance(r, Pong) and self._hearts.on_pong(nid, r.seq, r.sent_ns):
                self._last_pong[nid] = time.monotonic_ns()
                self._fresh.set()
        except (TransportTimeout, PeerUnavailable):
            pass  # silence: the heartbeat fails the agent at its deadline
        except ProtocolError as e:
            self._event("error", f"{card.name}: {e}")

    def _request_status(self, nid: str, card) -> None:
        try:
            st = self._client(nid, card).request(StatusRequest(), timeout=self.ping_timeout_s)
            if isinstance(st, StatusReply):
                self._status[nid] = st
        except (TransportTimeout, PeerUnavailable):
            pass
        except ProtocolError as e:
            self._event("error", f"{card.name}: {e}")

    # -- metric streams
    def _metrics_loop(self) -> None:
        connected: set[str] = set()
        while not self._stop.is_set():
            for ep in list(self._subscribed - connected):
                self._sub.connect(ep)
                connected.add(ep)
            try:
                env = self._sub.recv(timeout=0.2)
            except (TransportTimeout, ProtocolError):
                continue
            msg = env.msg
            now = time.monotonic()
            if isinstance(msg, BlockMetrics):
                with self._lock:
                    s = self._sessions.get(msg.session_id)
                    if s is None:
                        s = self._sessions[msg.session_id] = SessionMetrics(
                            session_id=msg.session_id, verifier=self._name(msg.node_id))
                    s.apply(msg, now)
                self._fresh.set()
            elif isinstance(msg, AgentEvent):
                self._event(msg.kind, msg.text)

    # -- SnapshotSource
    def snapshot(self) -> FleetSnapshot:
        now_ns = time.monotonic_ns()
        now = time.monotonic()
        hosts = []
        with self._lock:
            cards = dict(self._cards)
            sessions = [s.view(now) for s in self._sessions.values()]
            events = tuple(self._events)
        for nid, c in cards.items():
            rtt = self._hearts.rtt(nid)
            st = self._status.get(nid)
            state = self._hearts.state(nid) if nid in self._hearts.peers() else PeerState.WAITING
            last = self._last_pong.get(nid)
            hosts.append(HostView(
                node_id=nid, name=c.name, chip=c.chip, roles=tuple(c.roles),
                models=tuple(c.models), mem_used=st.mem_used if st else 0,
                mem_total=c.mem_total, load=st.load if st else 0.0,
                heartbeat_age_s=(now_ns - last) / 1e9 if last else None,
                rtt_ms=None if math.isnan(rtt.p50_ms) else rtt.p50_ms,
                alive=state is not PeerState.FAILED, address=c.router_endpoint))
        return FleetSnapshot(taken_at=time.time(), fleet_id=self.fleet_id, hosts=tuple(hosts),
                             links=link_views(sessions), sessions=tuple(sessions),
                             events=events)

    def poll(self, timeout_s: float) -> FleetSnapshot | None:
        if self._stop.is_set() or not self._fresh.wait(timeout_s):
            return None
        self._fresh.clear()
        return self.snapshot()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._fresh.set()
        self._hearts.stop()
        for t in self._threads:
            t.join(2.0)
        self._browser.close()
        self._sub.close()
        for c in self._clients.values():
            c.close()
