"""The live fleet observer: Zeroconf + heartbeats + the agents' metric streams -> snapshots.

It is the dashboard's `SnapshotSource`. A background thread browses for the fleet's agents,
pings each one every period (RTT, liveness through `bridge.heartbeat`: a SIGKILLed agent keeps
its Zeroconf card but stops answering, and is shown dead), asks their status now and then,
and subscribes to their PUB sockets for BlockMetrics and AgentEvents. `poll()` hands out the
newest snapshot. Widgets never see a socket.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

from bridge.auth import fleet_id as fleet_id_of
from bridge.discovery import ALL_INTERFACES, LOOPBACK_ONLY, Browser, CardAdded, CardRemoved
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.heartbeat import HeartTable, PeerState
from bridge.messages import (AgentEvent, BlockMetrics, Ping, Pong, StatusReply, StatusRequest)
from bridge.transport import Client, Subscriber
from macfleet.fleet.metrics import SessionMetrics
from macfleet.fleet.snapshot import (FleetEvent, FleetSnapshot, HostView, LinkView,
                                     SnapshotSource)

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 1.0
DEFAULT_PING_TIMEOUT_S = 0.5
DEFAULT_DEADLINE_S = 3.0
DEFAULT_STATUS_EVERY = 3
MAX_EVENTS = 200


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
        self._hearts = HeartTable(deadline_s=deadline_s)
        self._cards: dict[str, object] = {}
        self._status: dict[str, StatusReply] = {}
        self._last_pong: dict[str, int] = {}
        self._clients: dict[str, Client] = {}
        self._sessions: dict[str, SessionMetrics] = {}
        self._stop = threading.Event()
        self._fresh = threading.Event()
        self._seq = 0
        self._tick = 0
        self._sub = Subscriber(key=key)
        self._subscribed: set[str] = set()
        self._browser = Browser(fleet_id=self.fleet_id,
                                interfaces=LOOPBACK_ONLY if loopback else ALL_INTERFACES,
                                on_change=self._on_discovery)
        self._threads = [threading.Thread(target=self._heart_loop, daemon=True, name="observe"),
                         threading.Thread(target=self._metrics_loop, daemon=True, name="metrics")]
        for t in self._threads:
            t.start()

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

    # -- heartbeats and status
    def _heart_loop(self) -> None:
        while not self._stop.wait(0 if self._tick == 0 else self.period_s):
            self._tick += 1
            cards = {c.node_id: c for c in self._browser.cards()}
            with self._lock:
                self._cards = cards
            for nid, card in cards.items():
                self._subscribed.add(card.pub_endpoint)
                self._ping(nid, card)
            report = self._hearts.tick(time.monotonic_ns())
            for nid in report.failed:
                self._event("heartbeat_lost", f"{self._name(nid)} stopped answering heartbeats")
            for nid in report.recovered:
                self._event("heartbeat_back", f"{self._name(nid)} answers heartbeats again")
            self._fresh.set()

    def _name(self, nid: str) -> str:
        c = self._cards.get(nid)
        return c.name if c is not None else nid

    def _ping(self, nid: str, card) -> None:
        client = self._clients.get(nid)
        if client is None or client.endpoint != card.router_endpoint:
            client = self._clients[nid] = Client(card.router_endpoint, key=self.key,
                                                 connect_timeout_s=self.ping_timeout_s)
        self._seq += 1
        now = time.monotonic_ns()
        self._hearts.beat_sent(nid, self._seq, now)
        try:
            r = client.request(Ping(self._seq, now), timeout=self.ping_timeout_s)
            if isinstance(r, Pong) and self._hearts.pong(nid, r.seq, r.sent_ns,
                                                         time.monotonic_ns()):
                self._last_pong[nid] = time.monotonic_ns()
            if self._tick % DEFAULT_STATUS_EVERY == 1:
                st = client.request(StatusRequest(), timeout=self.ping_timeout_s)
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
                            msg.session_id, self._name(msg.node_id))
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
        links = []
        for s in sessions:
            wires = sorted(b.wire_ms for b in s.timeline if b.wire_ms > 0)
            if wires:
                links.append(LinkView(s.verifier, ", ".join(s.proposers) or "proposer",
                                      wires[len(wires) // 2],
                                      wires[min(len(wires) - 1, int(len(wires) * 0.95))]))
        return FleetSnapshot(time.time(), self.fleet_id, tuple(hosts), tuple(links),
                             tuple(sessions), events)

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
        for t in self._threads:
            t.join(2.0)
        self._browser.close()
        self._sub.close()
        for c in self._clients.values():
            c.close()
