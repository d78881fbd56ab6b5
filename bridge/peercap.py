"""Caps on the connections peers hold to a listening socket (ROUTER, PUB), so that keyless
traffic can neither exhaust the agent's file descriptors nor lock out a key holder.

ZeroMQ hides accepted connections from the application; its socket monitor does not: it reports
every accepted connection with its fd and every lost one. `PeerTable` (pure) keeps each open
connection's address, age and state and decides; `PeerGuard` (the shell, one thread per socket)
reads the monitor, dups an accepted fd to learn the peer's address and shuts down (`SHUT_RDWR`
on the dup reaches the shared TCP socket) the connections the table gives up: libzmq sees a lost
connection and cleans it up as any other.

Two kinds of connection are counted apart:
- *pending*: accepted, not yet known to have completed the CURVE handshake. Keyless traffic only
  ever makes these. One address may hold `per_address` of them and all addresses together
  `pending`; over either cap the *oldest* pending connection gives way (not the newest: a key
  holder's new connection only needs the few milliseconds of its handshake, while a flood that
  held the cap would otherwise refuse it for as long as the flood lasts);
- *authenticated*: a connection that delivered a message (the ROUTER's loop reports the
  message's source fd: only a peer that completed the handshake with the fleet's client key gets
  a message through), or that is still open after the handshake deadline (libzmq drops those
  that have not finished by then). These are never given up for pending ones, so keyless
  traffic from the key holder's own address or from many addresses cannot take them.
`total` caps both together, a budget well below the process's descriptor limit (`caps_for`); at
the total, a pending connection gives way, or (all authenticated) the new one is refused.

Why not ZAP: a ZAP handler only hears of a connection once it sends a HELLO, so idle TCP
connections never reach it, and it does not hear of disconnects to count them down.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

DEFAULT_MAX_PER_PEER = 64  # pending connections one address may hold to one socket; 0: no cap
DEFAULT_MIN_LIFE_S = 0.5  # a new connection's time to complete its handshake before it can go
DEFAULT_FD_SHARE = 4  # each listening socket may use 1/4 of the descriptors (ROUTER + PUB: 1/2)
MIN_TOTAL = 64
_BATCH = 1024  # monitor events read before acting on them
_EARLY_MAX = 1024
EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
          | zmq.EVENT_MONITOR_STOPPED)


@dataclass(frozen=True)
class ConnCaps:
    """per_address / pending: pending connections one address / all may hold; total: all
    connections (0: no cap, each); promote_s: a connection open this long has completed its
    handshake (None: only a delivered message says so, e.g. an open fleet's); min_life_s: a
    pending connection younger than this never gives way (its handshake's time): one address
    may then exceed `per_address`, within `pending`, and at `pending` or `total` the newcomer
    is refused."""

    per_address: int = DEFAULT_MAX_PER_PEER
    pending: int = 0
    total: int = 0
    promote_s: float | None = None
    min_life_s: float = DEFAULT_MIN_LIFE_S

    def __post_init__(self) -> None:
        if min(self.per_address, self.pending, self.total) < 0:
            raise ValueError(f"caps must be >= 0 (0: no cap), got {self}")


def caps_for(fd_limit: int, per_address: int = DEFAULT_MAX_PER_PEER,
             promote_s: float | None = None) -> ConnCaps:
    """The caps of one listening socket of a process allowed `fd_limit` descriptors (pure):
    all its connections within a quarter of them, pending ones within half of that."""
    total = max(MIN_TOTAL, fd_limit // DEFAULT_FD_SHARE) if fd_limit > 0 else 0
    pending = max(per_address, total // 2) if total else 0
    return ConnCaps(per_address=per_address, pending=pending, total=total, promote_s=promote_s)


def fd_limit() -> int:
    """This process's soft descriptor limit now (-1: unknown or unlimited)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return -1 if soft == resource.RLIM_INFINITY else int(soft)


@dataclass
class _Conn:
    address: str
    since: float
    peer: object = None  # what the shell checks before closing it (the (ip, port) it had)


class PeerTable:
    """Open connections by fd: address, age, pending or authenticated (pure: no sockets; the
    clock comes in as `now`).

    `accepted(fd, address, now, peer)` records a new connection and returns the (fd, peer) of
    the connections to close now (older pending ones that give way, or this one). `authenticated(fd)` moves one out
    of the pending caps. `closed(fd)` forgets it. fds are reused by the kernel, so an fd
    accepted again before its close was seen replaces the old entry instead of counting twice.
    """

    def __init__(self, caps: ConnCaps | int) -> None:
        if isinstance(caps, int):
            caps = ConnCaps(per_address=caps)
        self.caps = caps
        self._by_fd: dict[int, _Conn] = {}
        self._pending: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._pending_of: dict[str, OrderedDict[int, None]] = {}
        self._counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # connections given up, per address
        # fds that delivered a message before their accept event was read (the server loop
        # and the monitor's reader race): recorded as authenticated when it comes
        self._early: OrderedDict[int, None] = OrderedDict()

    @property
    def cap(self) -> int:
        return self.caps.per_address

    def accepted(self, fd: int, address: str, now: float = 0.0,
                 peer: object = None) -> list[tuple[int, object]]:
        early = self._early.pop(fd, False) is None  # it delivered a message already
        self.closed(fd)
        self._promote(now)
        caps, drop = self.caps, []
        for full, queue in ((caps.total and len(self._by_fd) >= caps.total, self._pending),
                            (caps.pending and len(self._pending) >= caps.pending, self._pending)):
            if full:
                old = self._oldest(queue, now)
                if old is None:  # all authenticated, or all still in their handshake
                    self.dropped[address] += 1
                    return [*drop, (fd, peer)]
                drop.append(self._give_up(old))
        mine = self._pending_of.get(address)
        while caps.per_address and mine and len(mine) >= caps.per_address:
            old = self._oldest(mine, now)
            if old is None:
                break
            drop.append(self._give_up(old))
            mine = self._pending_of.get(address)
        self._by_fd[fd] = _Conn(address, now, peer)
        self._counts[address] += 1
        if early:
            return drop
        self._pending[fd] = None
        self._pending_of.setdefault(address, OrderedDict())[fd] = None
        return drop

    def _oldest(self, queue: OrderedDict[int, None], now: float) -> int | None:
        """The oldest pending fd of `queue` if it is past its handshake's time."""
        fd = next(iter(queue), None)
        if fd is None or now - self._by_fd[fd].since < self.caps.min_life_s:
            return None
        return fd

    def authenticated(self, fd: int) -> None:
        """The connection on fd completed its handshake: out of the pending caps."""
        if fd in self._pending:
            self._unpend(fd)
        elif fd not in self._by_fd:
            self._early[fd] = None
            while len(self._early) > _EARLY_MAX:
                self._early.popitem(last=False)

    def _promote(self, now: float) -> None:
        if self.caps.promote_s is None:
            return
        while self._pending:
            fd = next(iter(self._pending))
            if now - self._by_fd[fd].since < self.caps.promote_s:
                return
            self._unpend(fd)

    def _unpend(self, fd: int) -> None:
        self._pending.pop(fd, None)
        address = self._by_fd[fd].address
        mine = self._pending_of.get(address)
        if mine is not None:
            mine.pop(fd, None)
            if not mine:
                del self._pending_of[address]

    def _give_up(self, fd: int) -> tuple[int, object]:
        conn = self._by_fd[fd]
        self.dropped[conn.address] += 1
        self.closed(fd)
        return fd, conn.peer

    def closed(self, fd: int) -> None:
        conn = self._by_fd.get(fd)
        if conn is None:
            self._early.pop(fd, None)
            return
        self._unpend(fd)
        del self._by_fd[fd]
        self._counts[conn.address] -= 1
        if not self._counts[conn.address]:
            del self._counts[conn.address]

    def count(self, address: str) -> int:
        return self._counts.get(address, 0)

    @property
    def total(self) -> int:
        return len(self._by_fd)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def counts(self) -> dict[str, int]:
        """Open connections per address, pending and authenticated."""
        return dict(self._counts)

    def pending_counts(self) -> dict[str, int]:
        return {a: len(fds) for a, fds in self._pending_of.items()}


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


def _peer(fd: int, endpoint: str) -> tuple[str, int] | None:
    """The remote (address, port) of the TCP connection on fd, if fd is still one accepted on
    the listener of `endpoint` (same local port); None otherwise."""
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
            name = s.getpeername()
            return str(name[0]), int(name[1])
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

    def __init__(self, sock: zmq.Socket, caps: ConnCaps | int, monitor: zmq.Socket, *,
                 name: str = "") -> None:
        """monitor: a PAIR receiving `sock`'s events `EVENTS` (bridge.sockets._monitor)."""
        self.table = PeerTable(caps)
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

    def pending_counts(self) -> dict[str, int]:
        with self._lock:
            return self.table.pending_counts()

    def authenticated(self, fd: int) -> None:
        """A message arrived on fd (any thread): its peer completed the handshake."""
        with self._lock:
            self.table.authenticated(fd)

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
            peer = _peer(fd, endpoint)
            if peer is None:
                continue
            with self._lock:
                gone = self.table.accepted(fd, peer[0], time.monotonic(), peer)
                drops = self.table.dropped[peer[0]]
            for old, was in gone:
                # a connection given up may have closed since: touch its fd only while it is
                # still the same TCP connection (same listener, same peer address and port)
                if old == fd or _peer(old, endpoint) == was:
                    _shutdown(old)
            if gone and (drops in (1, 10, 100, 1000) or drops % 10000 == 0):
                log.warning("%s: connections over the caps (%s); %d given up from %s so far",
                            endpoint, self.table.caps, drops, peer[0])
        return True
