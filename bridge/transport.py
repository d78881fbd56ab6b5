"""Thin shells over ZeroMQ: Server (ROUTER) and Client (DEALER); PUB/SUB are in bridge.pubsub.

All logic that can be pure lives in codec and auth; this module only moves frames, enforces caps
and deadlines, and keeps one rule of ZeroMQ: a socket is used by one thread at a time. The Server
owns its ROUTER in its loop thread; replies from other threads go through a queue and a wake-up
socketpair the loop polls beside the ROUTER, so a worker's reply leaves at once rather than at the
next poll tick. After a timed-out request the Client rebuilds its DEALER instead of reusing it, so
a late reply can never be mistaken for the next one's.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import zmq

from bridge.codec import (Envelope, Header, Limits, encode, encode_error, frames_nbytes, new_id,
                          peek_id)
from bridge.errors import (INTERNAL, PeerUnavailable, ProtocolError,
                           TransportTimeout)
from bridge.messages import ErrorReply, Message, is_terminal
from bridge.sockets import (DEFAULT_BIND, DEFAULT_RECV_TIMEOUT_S, _bind, _guard, _recv_capped,
                            _Shell, _socket, port_of)

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 0.1  # how soon the server loop notices close()
DEFAULT_CLOSE_TIMEOUT_S = 2.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0  # wait for a usable connection before sending
DEFAULT_REQUEST_TIMEOUT_S = 10.0
DEFAULT_STREAM_TIMEOUT_S = 30.0  # per streamed message
SERVE_BATCH = 64  # requests per loop turn before queued replies are flushed

Reply = Callable[[Message], int]  # sends one reply, returns its wire bytes
Handler = Callable[[Envelope, Reply], None]
class Server(_Shell):
    """A ROUTER serving `handler(envelope, reply)` in one loop thread.

    `reply(msg)` may be called zero, one or many times (streaming), from any thread, also after
    the handler returned. The handler runs on the loop thread: hand long work to a worker and
    reply from there. A request that fails decoding gets an ErrorReply with its code (only peers
    that completed the CURVE handshake get this far, or anyone on an open fleet); a
    handler raising ProtocolError gets that code; any other exception becomes ErrorReply(internal)
    and is logged. The server never dies of a request.
    """

    def __init__(self, handler: Handler, *, key: bytes | None, bind: str = DEFAULT_BIND,
                 context: zmq.Context | None = None, limits: Limits = Limits(),
                 poll_s: float = DEFAULT_POLL_S, max_per_peer: int | None = None) -> None:
        """max_per_peer: pending (not yet authenticated) connections one address may hold
        (None: bridge.peercap's default, 0: no caps); `peers` is the bridge.peercap.PeerGuard
        applying it with a budget of this process's descriptors."""
        self._handler = handler
        self._key = key
        self._limits = limits
        self._poll_ms = max(1, int(poll_s * 1000))
        self._sock = _socket(context or zmq.Context.instance(), zmq.ROUTER, limits, key=key)
        self.peers = _guard(self._sock, max_per_peer, bind, key=key)
        # a message on a connection proves its handshake: out of the pending caps at once
        self._on_fd = self.peers.authenticated if self.peers is not None else None
        self.endpoint = _bind(self._sock, bind)
        self._wake_r, self._wake_w = socket.socketpair()  # workers' replies wake the loop
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._outbox: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_ident: int | None = None
        self.requests = 0
        self.errors = 0  # error replies sent (malformed, auth, handler errors)
        if key is None:
            log.warning("server %s runs an OPEN fleet: no CURVE, anyone reaching it is served",
                        self.endpoint)

    @property
    def port(self) -> int:
        return port_of(self.endpoint)

    def start(self) -> Server:
        with self._lock:
            if self._closed:
                raise RuntimeError("server closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"bridge-server {self.endpoint}",
                                                daemon=True)
                self._thread.start()
        return self

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Stop the loop and close the socket (idempotent); pending replies are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._stop.set()
            self._wake()
        if thread is None:
            self._close_sockets()
            return
        thread.join(timeout)  # the loop thread closes its sockets on the way out
        if thread.is_alive():
            log.warning("server %s loop still busy after %.1fs (a slow handler?)", self.endpoint, timeout)

    def _close_sockets(self) -> None:
        self._sock.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> Server:
        return self.start()

    # --- loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        self._loop_ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms))
                if self._wake_r.fileno() in events:
                    self._drain_wake()
                self._flush()
                if self._sock in events:
                    for _ in range(SERVE_BATCH):
                        if self._stop.is_set() or not self._sock.poll(0, zmq.POLLIN):
                            break
                        self._serve(*_recv_capped(self._sock, self._limits.max_frames + 1,
                                                  self._on_fd))
                        self._flush()
        except zmq.ContextTerminated:
            log.info("server %s: context terminated", self.endpoint)
        finally:
            with self._lock:  # not while close() or a worker is still writing a wake-up byte
                self._close_sockets()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:  # drained
            return

    def _flush(self) -> None:
        while True:
            try:
                frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(frames)

    def _send(self, frames: list[Any]) -> None:
        try:  # ROUTER drops (never blocks) on unknown peers and full pipes
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("server %s: reply dropped (peer queue full)", self.endpoint)

    def _serve(self, parts: list[memoryview], count: int) -> None:
        identity, payload = bytes(parts[0]), parts[1:]
        self.requests += 1
        try:
            env = self._unwrap(payload, count - 1)
        except ProtocolError as exc:
            log.info("server %s refused a message: %s", self.endpoint, exc)
            if exc.msg_id is None and payload:
                exc.msg_id = peek_id(payload[0])
            self._send_error(identity, exc, None)
            return
        try:
            self._handler(env, self._replier(identity, env.header))
        except ProtocolError as exc:
            self._send_error(identity, exc, env.header)
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server
            log.exception("server %s: handler failed on %s", self.endpoint, env.header.type)
            self._send_error(identity, ProtocolError(INTERNAL, f"{type(exc).__name__}: {exc}"), env.header)

    def _send_error(self, identity: bytes, exc: ProtocolError, request: Header | None) -> None:
        self.errors += 1
        self._send([identity, *encode_error(exc, request=request)])

    # --- any thread --------------------------------------------------------------------------

    def _replier(self, identity: bytes, request: Header) -> Reply:
        return Replier(self, identity, request)

    def _post(self, frames: list[Any]) -> None:
        if threading.get_ident() == self._loop_ident:
            self._flush()  # replies queued by workers before this one leave first
            self._send(frames)
            return
        with self._lock:
            if self._closed:
                log.debug("server %s closed; reply dropped", self.endpoint)
                return
            self._outbox.put(frames)
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:  # buffer full: the loop is already due to wake
            pass


class Replier:
    """`reply(msg)` for one request; `peer` names the connection it came on (the ROUTER's
    routing id), so services can apply per-client quotas."""

    __slots__ = ("_server", "peer", "_request")

    def __init__(self, server: Server, peer: bytes, request: Header) -> None:
        self._server, self.peer, self._request = server, peer, request

    def __call__(self, msg: Message) -> int:
        frames = encode(msg, reply_to=self._request.id, session=self._request.session)
        self._server._post([self.peer, *frames])
        return frames_nbytes(frames)


class Client(_Shell):
    """A DEALER to one agent. Not thread-safe: one thread per Client.

    request() and stream() match replies to their request by reply_to and discard others (stale
    replies, replies to earlier pipelined sends). send()/recv() are the pipelined form: recv
    returns every well-formed message, ErrorReply included, and does not rebuild on timeout (call
    reset() when the link is to be abandoned).
    """

    def __init__(self, endpoint: str, *, key: bytes | None, context: zmq.Context | None = None,
                 limits: Limits = Limits(),
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 watch_peer: bool = False) -> None:
        """watch_peer: a lost connection (the peer's process died, its socket closed) fails a
        pending recv at once with PeerUnavailable instead of waiting out its deadline (a peer
        asleep or cut off still costs the deadline: TCP does not tell)."""
        self.endpoint = endpoint
        self._watch = watch_peer
        self._mon: zmq.Socket | None = None
        self._key = key
        self._ctx = context or zmq.Context.instance()
        self._limits = limits
        self._connect_ms = int(connect_timeout_s * 1000)
        self._sock: zmq.Socket | None = self._connect()
        self.bytes_sent = self.bytes_received = 0
        self.last_sent_bytes = self.last_recv_bytes = 0
        self.dropped = 0  # received messages that failed auth or decoding
        self.rebuilds = 0

    def _connect(self) -> zmq.Socket:
        sock = _socket(self._ctx, zmq.DEALER, self._limits, key=self._key)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: no-peer is visible
        if self._watch:
            self._mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        return sock

    def _unwatch(self) -> None:
        if self._mon is not None:
            if self._sock is not None:
                self._sock.disable_monitor()
            self._mon.close(linger=0)
            self._mon = None

    def reset(self) -> None:
        """Drop the socket (and anything queued or in flight on it) and connect a new one."""
        self._live()
        self._unwatch()
        self._sock.close(linger=0)
        self._sock = self._connect()
        self.rebuilds += 1

    def close(self, linger_ms: int = 0) -> None:
        self._unwatch()
        super().close(linger_ms)

    def _peer_lost(self) -> bool:
        """Drain the monitor; True when the connection was lost since the last drain."""
        lost = False
        while self._mon is not None and self._mon.poll(0, zmq.POLLIN):
            from zmq.utils.monitor import recv_monitor_message

            lost |= recv_monitor_message(self._mon)["event"] == zmq.EVENT_DISCONNECTED
        return lost

    def _wait_readable(self, deadline: float) -> None:
        """With watch_peer: wait for a message or a lost connection (PeerUnavailable)."""
        if self._mon is None:
            return
        poller = zmq.Poller()
        poller.register(self._live(), zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self._sock in ready or not ready:
                return  # a message, or the deadline: _poll_recv says which
            if self._peer_lost():
                raise PeerUnavailable(f"connection to {self.endpoint} lost (its agent died?)")

    def send(self, msg: Message, *, session: str = "") -> str:
        """Send one message; returns its id. PeerUnavailable when no connection is usable in time."""
        sock = self._live()
        msg_id = new_id()
        frames = encode(msg, msg_id=msg_id, session=session)
        if not sock.poll(self._connect_ms, zmq.POLLOUT):
            raise PeerUnavailable(f"no connection to {self.endpoint} within {self._connect_ms} ms "
                                  "(agent down, or its fleet key differs from ours)")
        self._peer_lost()  # a connection lost before this send is not this request's news
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise PeerUnavailable(f"send queue to {self.endpoint} is full") from None
        self.last_sent_bytes = frames_nbytes(frames)
        self.bytes_sent += self.last_sent_bytes
        return msg_id

    def recv(self, timeout: float = DEFAULT_RECV_TIMEOUT_S) -> Envelope:
        """The next well-formed message; TransportTimeout at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            self._wait_readable(deadline)
            parts, count = self._poll_recv(deadline, 0, self.endpoint)
            nbytes = sum(p.nbytes for p in parts)
            self.bytes_received += nbytes
            env = self._accept(parts, count)
            if env is not None:
                self.last_recv_bytes = nbytes
                return env

    def _accept(self, parts: list[memoryview], count: int) -> Envelope | None:
        try:
            return self._unwrap(parts, count)
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("client %s dropped a message: %s", self.endpoint, exc)
            return None

    def _await(self, msg_id: str, timeout: float) -> Envelope:
        deadline = time.monotonic() + timeout  # stale messages do not extend it
        try:
            while True:
                env = self.recv(max(0.0, deadline - time.monotonic()))
                if env.header.reply_to == msg_id:
                    if isinstance(env.msg, ErrorReply):
                        raise ProtocolError(env.msg.code, env.msg.message, msg_id=msg_id)
                    return env
                log.debug("client %s discarded a stale %s", self.endpoint, env.header.type)
        except TransportTimeout:
            self.reset()
            raise

    def request(self, msg: Message, timeout: float = DEFAULT_REQUEST_TIMEOUT_S, *,
                session: str = "") -> Message:
        """Send and wait for the first reply. ProtocolError for an ErrorReply; TransportTimeout
        (after which the socket is rebuilt) at the deadline."""
        deadline = time.monotonic() + timeout
        msg_id = self.send(msg, session=session)
        return self._await(msg_id, max(0.0, deadline - time.monotonic())).msg

    def stream(self, msg: Message, timeout_per_msg: float = DEFAULT_STREAM_TIMEOUT_S, *,
               session: str = "") -> Iterator[Message]:
        """Send and yield replies until one of a terminal type (see `message(terminal=...)`)."""
        msg_id = self.send(msg, session=session)
        while True:
            reply = self._await(msg_id, timeout_per_msg).msg
            yield reply
            if is_terminal(reply):
                return



# PUB/SUB live in bridge.pubsub; re-exported so `from bridge.transport import Publisher` works.
from bridge.pubsub import Publisher, Subscriber  # noqa: E402

__all__ = ["Client", "Handler", "Publisher", "Replier", "Reply", "Server", "Subscriber",
           "port_of"]
