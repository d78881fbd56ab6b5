"""A cap on the connections one peer address may hold to a listening socket (ROUTER, PUB).

CURVE sheds a peer without the key after the handshake interval, and the agent raises its fd
limit, but within that interval (and for key holders, forever) one address could still hold
thousands of connections, each an fd of the agent. ZeroMQ hides accepted connections from the
application; its socket monitor does not: it reports every accepted connection with its fd and
every lost one. `PeerTable` (pure) counts connections per address and decides; `PeerGuard` (the
shell, one thread per socket) reads the monitor, dups an accepted fd to learn the peer's address
and, when that address is over the cap, shuts the connection down on the dup (`SHUT_RDWR`
reaches the shared TCP socket): libzmq sees a lost connection and cleans it up as any other.
The peer sees its connection closed; connections it already holds are kept.

Why not ZAP: a ZAP handler only hears of a connection once it sends a HELLO, so idle TCP
connections never reach it, and it does not hear of disconnects to count them down.

The default cap is generous: a loopback fleet puts every agent, client and dashboard on
127.0.0.1, and a real fleet holds a few connections per Mac (requests, streams, heartbeats).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

DEFAULT_MAX_PER_PEER = 64  # connections one address may hold to one listening socket; 0: no cap
_BATCH = 1024  # monitor events read before acting on them
EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
          | zmq.EVENT_MONITOR_STOPPED)


class PeerTable:
    """Open connections per peer address, by fd (pure: no sockets, no clock).

    `accepted(fd, address)` records a new connection and says whether to keep it (False: the
    address already holds `cap`, drop this one; a dropped connection is never counted).
    `closed(fd)` forgets it. fds are reused by the kernel, so an fd accepted again before its
    close was seen replaces the old entry instead of counting twice.
    """

    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0 (0: no cap), got {cap}")
        self.cap = cap
        self._by_fd: dict[int, str] = {}
        self._counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # connections refused, per address

    def accepted(self, fd: int, address: str) -> bool:
        self.closed(fd)
        if self.cap and self._counts[address] >= self.cap:
            self.dropped[address] += 1
            return False
        self._by_fd[fd] = address
        self._counts[address] += 1
        return True

    def closed(self, fd: int) -> None:
        address = self._by_fd.pop(fd, None)
        if address is not None:
            self._counts[address] -= 1
            if not self._counts[address]:
                del self._counts[address]

    def count(self, address: str) -> int:
        return self._counts.get(address, 0)

    @property
    def total(self) -> int:
        return len(self._by_fd)

    def counts(self) -> dict[str, int]:
        return dict(self._counts)


def _live_fds(events: list[tuple[int, int, str]]) -> list[bool]:
    """For each event of a batch: False for an accept whose close is later in the same batch
    (its fd may already belong to another connection or file: never touch it)."""
    closed_later: set[int] = set()
    live = [True] * len(events)
    for i in range(len(events) - 1, -1, -1):
        kind, fd, _ = events[i]
        if kind == zmq.EVENT_ACCEPTED:
            live[i] = fd not in closed_later
            closed_later.discard(fd)
        elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            closed_later.add(fd)
    return live


def _dup(fd: int) -> socket.socket | None:
    """A socket object over a dup of fd (closing it leaves fd open); None if fd is no socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _peer_address(fd: int, endpoint: str) -> str | None:
    """The remote address of the TCP connection on fd, if fd is still one accepted on the
    listener of `endpoint` (same local port); None otherwise."""
    try:
        port = int(endpoint.rsplit(":", 1)[1])
    except (ValueError, IndexError):
        return None  # not TCP
    s = _dup(fd)
    if s is None:
        return None
    with s:
        try:
            if s.type != socket.SOCK_STREAM or s.getsockname()[1] != port:
                return None
            return str(s.getpeername()[0])
        except (OSError, IndexError, TypeError):  # already disconnected, or not IP
            return None


def _shutdown(fd: int) -> None:
    """Close the TCP connection under libzmq's fd without closing its fd (a dup is shut down:
    libzmq reads end-of-stream, reports a disconnect and closes its fd itself)."""
    s = _dup(fd)
    if s is None:
        return
    with s:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone


class PeerGuard:
    """Applies a PeerTable to a ZeroMQ socket, from its own thread.

    Create it before bind so no accepted connection is missed. The thread ends when the
    socket is closed (the monitor reports EVENT_MONITOR_STOPPED) and only then closes its end
    of the monitor: libzmq *blocks* the thread emitting an event (an I/O thread, or the reaper
    closing the socket) while the monitor has no reader, so closing that end earlier would
    stall every socket of the context.
    """

    def __init__(self, sock: zmq.Socket, cap: int, monitor: zmq.Socket, *,
                 name: str = "") -> None:
        """monitor: a PAIR receiving `sock`'s events `EVENTS` (bridge.sockets._monitor)."""
        self.table = PeerTable(cap)
        self._lock = threading.Lock()
        self._mon = monitor
        self._thread = threading.Thread(target=self._run, name=f"peer-guard {name}", daemon=True)
        self._thread.start()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return self.table.counts()

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return dict(self.table.dropped)

    def join(self, timeout: float) -> bool:
        """Wait for the guard to end (it does once its socket is closed); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                events = []
                while not events or (len(events) < _BATCH and self._mon.poll(0, zmq.POLLIN)):
                    m = parse_monitor_message(self._mon.recv_multipart())  # see _live_fds
                    events.append((m["event"], m["value"], m["endpoint"].decode(errors="replace")))
                if not self._apply(events):
                    return
        except zmq.ContextTerminated:  # libzmq no longer blocks on a terminating context
            pass
        finally:
            self._mon.close(linger=0)

    def _apply(self, events: list[tuple[int, int, str]]) -> bool:
        """Act on one batch of monitor events; False once the monitor stopped."""
        for (kind, fd, endpoint), live in zip(events, _live_fds(events)):
            if kind == zmq.EVENT_MONITOR_STOPPED:
                return False
            if kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                with self._lock:
                    self.table.closed(fd)
                continue
            if kind != zmq.EVENT_ACCEPTED or not live:
                continue
            address = _peer_address(fd, endpoint)
            if address is None:
                continue
            with self._lock:
                keep = self.table.accepted(fd, address)
                drops = self.table.dropped[address]
            if not keep:
                _shutdown(fd)
                if drops in (1, 10, 100, 1000) or drops % 10000 == 0:
                    log.warning("%s: %s holds %d connections (the cap); dropped %d over it",
                                endpoint, address, self.table.cap, drops)
        return True
