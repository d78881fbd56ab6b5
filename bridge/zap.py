"""ZAP for the closed fleet: a CURVE server admits only the fleet's client public key(s).

Without a ZAP handler libzmq's CURVE server accepts *any* client keypair whose HELLO it can open,
i.e. any peer that knows the server public key: the server key would be a password, and a
single leaked public key (a log, a capture of a config) would open the fleet. With this handler a
client must also prove, inside the handshake, that it holds the secret half of a client key the
fleet's key derives (`bridge.auth.curve_keys`), so admission rests on the fleet key itself.

libzmq asks the one handler bound at `inproc://zeromq.zap.01` of a context, for every CURVE
handshake of every socket of that context, naming the socket's ZAP domain. So there is one
handler thread per context (started on first use, before the first server socket binds), and a
table domain -> allowed client public keys: every closed fleet in the process (tests run agents
of several fleets side by side) registers its own domain. `decide` is the pure rule; the thread
is a thin shell.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import zmq

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
USER_ID = b"fleet-client"  # what libzmq attaches to an admitted peer's messages ("User-Id")
_POLL_MS = 500

_lock = threading.Lock()
_handlers: dict[int, _Handler] = {}  # id(context) -> its handler


def decide(allowed: Mapping[str, frozenset[bytes]], domain: str, mechanism: bytes,
           credentials: Sequence[bytes]) -> tuple[bytes, bytes]:
    """ZAP status code and text for one handshake (pure). Only CURVE in a registered domain
    with one of its client public keys (raw 32 bytes) is admitted."""
    if mechanism != b"CURVE":
        return b"400", b"only CURVE is admitted"
    keys = allowed.get(domain)
    if keys is None:
        return b"400", b"unknown domain"
    if len(credentials) != 1 or credentials[0] not in keys:
        return b"400", b"not a client key of this fleet"
    return b"200", b"OK"


class _Handler:
    """The ZAP handler thread of one context."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.allowed: dict[str, frozenset[bytes]] = {}
        self.denied = 0  # handshakes refused (a client key that is not the fleet's)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # bound before this returns: no handshake goes unasked
        self._thread = threading.Thread(target=self._run, name="zap-handler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                if not self._sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                msg = self._sock.recv_multipart()
                self._sock.send_multipart(self._answer(msg))
        except zmq.ContextTerminated:  # the context's term() waits for this socket
            self._sock.close(linger=0)
        except zmq.ZMQError as e:  # the context was destroyed under us
            log.debug("zap handler stopped: %s", e)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [ZAP_VERSION, msg[1] if len(msg) > 1 else b"", b"400", b"short", b"", b""]
        _, request_id, domain, address, _, mechanism = msg[:6]
        status, text = decide(self.allowed, domain.decode(errors="replace"), mechanism, msg[6:])
        if status != b"200":
            self.denied += 1
            log.info("refused a %s handshake from %s: %s", mechanism.decode(errors="replace"),
                     address.decode(errors="replace"), text.decode())
        return [ZAP_VERSION, request_id, status, text, USER_ID if status == b"200" else b"",
                b""]


def admit(ctx: zmq.Context, domain: str, client_publics: frozenset[bytes]) -> _Handler:
    """Make sure `ctx` has a ZAP handler and that it admits `client_publics` (raw 32-byte
    keys) to sockets of ZAP domain `domain`; returns the handler."""
    with _lock:
        h = _handlers.get(id(ctx))
        if h is None:
            h = _handlers[id(ctx)] = _Handler(ctx)
        h.allowed[domain] = h.allowed.get(domain, frozenset()) | client_publics
        return h


def denied(ctx: zmq.Context) -> int:
    """Handshakes the context's handler refused so far (0 when it has none)."""
    h = _handlers.get(id(ctx))
    return h.denied if h is not None else 0
