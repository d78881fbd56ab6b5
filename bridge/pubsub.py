"""PUB/SUB shells for metrics and events: CURVE-encrypted, so only fleet key holders can
subscribe.

Kept apart from the request/reply shells in `bridge.transport`; both build on
`bridge.sockets`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import zmq

from bridge.codec import Envelope, Limits, encode, frames_nbytes
from bridge.errors import ProtocolError
from bridge.messages import Message, tag_of
from bridge.sockets import (DEFAULT_BIND, DEFAULT_RECV_TIMEOUT_S, _bind, _guard, _Shell,
                            _socket, port_of)

log = logging.getLogger(__name__)

class Publisher(_Shell):
    """A PUB socket for metrics and events (a CURVE server: only key holders subscribe).

    Each message is `[topic, header, body, *buffers]`; the topic (default: the message tag)
    is only for SUB-side filtering. Thread-safe (a lock serializes
    sends); PUB never blocks and drops messages for slow subscribers.
    """

    def __init__(self, *, key: bytes | None, bind: str = DEFAULT_BIND,
                 context: zmq.Context | None = None, max_per_peer: int | None = None) -> None:
        """max_per_peer: connections one address may hold (None: bridge.peercap's default,
        0: no cap); `peers` is the bridge.peercap.PeerGuard applying it."""
        self._key = key
        self._sock: zmq.Socket | None = _socket(context or zmq.Context.instance(), zmq.PUB, key=key)
        self.peers = _guard(self._sock, max_per_peer, bind, key=key)
        self.endpoint = _bind(self._sock, bind)
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return port_of(self.endpoint)

    def publish(self, msg: Message, *, topic: str | None = None) -> int:
        """Publish one message; returns its wire bytes (0 once closed)."""
        frames = encode(msg)
        head = (topic if topic is not None else tag_of(msg)).encode()
        with self._lock:
            if self._sock is None:
                return 0
            self._sock.send_multipart([head, *frames], flags=zmq.NOBLOCK, copy=False)
        return frames_nbytes(frames)

    def close(self) -> None:
        with self._lock:
            super().close()


class Subscriber(_Shell):
    """A SUB socket over any number of publishers. Not thread-safe: connect/recv from one thread.

    Messages that fail decoding are dropped (counted in `dropped`) and recv keeps waiting.
    """

    def __init__(self, endpoints: Sequence[str] = (), *, key: bytes | None,
                 topics: Sequence[str] = ("",), context: zmq.Context | None = None,
                 limits: Limits = Limits()) -> None:
        self._key = key
        self._limits = limits
        self._sock: zmq.Socket | None = _socket(context or zmq.Context.instance(), zmq.SUB, limits, key=key)
        for t in topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        for e in endpoints:
            self.connect(e)
        self.dropped = 0

    def connect(self, endpoint: str) -> None:
        self._live().connect(endpoint)

    def disconnect(self, endpoint: str) -> None:
        self._live().disconnect(endpoint)

    def recv(self, timeout: float = DEFAULT_RECV_TIMEOUT_S) -> Envelope:
        """The next well-formed message; TransportTimeout at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            parts, count = self._poll_recv(deadline, 1, "publishers")
            try:  # parts[0] is the topic
                return self._unwrap(parts[1:], count - 1)
            except ProtocolError as exc:
                self.dropped += 1
                log.warning("subscriber dropped a message: %s", exc)
