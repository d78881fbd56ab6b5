"""Socket helpers shared by the request/reply (`bridge.transport`) and PUB/SUB
(`bridge.pubsub`) shells: creation with caps, binding, capped receives, the common base."""

from __future__ import annotations

import os
import time
from itertools import count
from typing import Callable, TypeVar

import zmq

from bridge import peercap
from bridge.auth import DEFAULT_HANDSHAKE_S, apply_curve
from bridge.codec import Envelope, Limits
from bridge.errors import OVERSIZE, ProtocolError, TransportTimeout

DEFAULT_BIND = "tcp://127.0.0.1:*"
DEFAULT_RECV_TIMEOUT_S = 10.0
PROMOTE_MARGIN_S = 0.5

_S = TypeVar("_S", bound="_Shell")


_SERVER_KINDS = (zmq.ROUTER, zmq.PUB)  # bind and hold the CURVE server key; the rest connect
_MONITORS = count()  # unique inproc names (pyzmq's default reuses a closed socket's fd number)


def _socket(ctx: zmq.Context, kind: int, limits: Limits | None = None, *,
            key: bytes | None = None) -> zmq.Socket:
    """A socket with linger 0, the size cap and (key not None) CURVE for the fleet of `key`."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        apply_curve(sock, key, server=kind in _SERVER_KINDS)
    except Exception:
        sock.close(linger=0)
        raise
    if limits is not None:
        # libzmq disconnects a peer sending a frame above this instead of buffering it; frames
        # between the caps and this still get a typed oversize reply.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * max(limits.max_frame_bytes, limits.max_body_bytes))
    return sock


def _monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR receiving `sock`'s monitor events, with no queue limit: libzmq blocks the thread
    emitting an event (an I/O thread) while the monitor's queue is full."""
    addr = f"inproc://macfleet-monitor-{os.getpid()}-{next(_MONITORS)}"
    sock.monitor(addr, events)
    mon = sock.context.socket(zmq.PAIR)
    mon.setsockopt(zmq.LINGER, 0)
    mon.setsockopt(zmq.RCVHWM, 0)
    mon.connect(addr)
    return mon


def _guard(sock: zmq.Socket, max_per_peer: int | None, name: str, *,
           key: bytes | None) -> peercap.PeerGuard | None:
    """Cap the connections of a listening socket (call before bind): pending ones per peer
    address (None: `peercap.DEFAULT_MAX_PER_PEER`, 0: no caps at all), pending and all ones
    within a budget of this process's descriptor limit (`peercap.caps_for`)."""
    cap = peercap.DEFAULT_MAX_PER_PEER if max_per_peer is None else max_per_peer
    if not cap:
        return None
    # in a closed fleet a connection still open after the handshake deadline has the key
    promote = None if key is None else DEFAULT_HANDSHAKE_S + PROMOTE_MARGIN_S
    caps = peercap.caps_for(peercap.fd_limit(), cap, promote)
    return peercap.PeerGuard(sock, caps, _monitor(sock, peercap.EVENTS), name=name)


def _bind(sock: zmq.Socket, bind: str) -> str:
    """Bind (a `*` port picks a free one) and return the endpoint actually bound."""
    try:
        sock.bind(bind)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _recv_capped(sock: zmq.Socket, cap: int,
                 on_fd: Callable[[int], None] | None = None) -> tuple[list[memoryview], int]:
    """One multipart message (already waiting: poll first), keeping at most `cap` frames so a
    peer cannot make us hold a million of them; returns (kept frames, frames received).
    on_fd: told the fd of the connection the message came on."""
    kept: list[memoryview] = []
    count = 0
    while True:
        frame = sock.recv(zmq.NOBLOCK, copy=False)  # multipart delivery is atomic
        if on_fd is not None and not count:
            on_fd(frame.get(zmq.SRCFD))
        count += 1
        if count <= cap:
            kept.append(frame.buffer)
        if not frame.more:
            return kept, count


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


class _Shell:
    """What every shell shares: an owned socket (close() idempotent, use after close refused)
    and the path from received frames to a typed message: caps, then decode. (Who may send at
    all was settled by CURVE when the connection was made.)"""

    _sock: zmq.Socket | None = None
    _key: bytes | None = None
    _limits: Limits = Limits()

    def _unwrap(self, parts: list[memoryview], count: int) -> Envelope:
        if count > self._limits.max_frames:
            raise ProtocolError(OVERSIZE, f"{count} frames exceed {self._limits.max_frames}")
        return self._limits.decode(parts)

    def _live(self) -> zmq.Socket:
        if self._sock is None:
            raise RuntimeError(f"{type(self).__name__} closed")
        return self._sock

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms: how long messages still queued may take to leave (0: dropped)."""
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _poll_recv(self, deadline: float, extra: int, what: str) -> tuple[list[memoryview], int]:
        """Wait for one message; `extra` frames precede the message's own (topic, identity)."""
        sock = self._live()
        if not sock.poll(_ms_left(deadline), zmq.POLLIN):
            raise TransportTimeout(f"no message from {what} before the deadline")
        return _recv_capped(sock, self._limits.max_frames + 1 + extra)


