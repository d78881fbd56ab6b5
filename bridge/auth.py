"""The fleet key: ZeroMQ CURVE on every socket, an HMAC-SHA256 on every message, a replay window.

One 32-byte fleet key, copied to every Mac, is the only secret. Everything else derives from it:

- CURVE (`curve_keys`): a server keypair (ROUTER and PUB sockets) and a client keypair (DEALER
  and SUB sockets), each secret = HMAC-SHA256(fleet key, label) taken as a Curve25519 scalar
  (libsodium clamps it), the public half computed by `zmq.curve_public`. The server *public* key
  is never published (Zeroconf TXT carries only `fleet_id`, a hash), so it acts as a second
  secret: a peer that does not hold the fleet key cannot build a HELLO the server can open, the
  handshake fails and libzmq closes the connection before one byte reaches the application. An
  unauthenticated peer therefore gets nothing back: no typed error, no signed echo. Traffic is
  encrypted (XSalsa20-Poly1305 per frame) and each connection's short-term keys and nonces stop
  an outsider from replaying or splicing captured traffic. Sockets that never finish the
  handshake are dropped after `DEFAULT_HANDSHAKE_S` (`zmq.HANDSHAKE_IVL`).
- The per-message HMAC and the replay window are kept, for what CURVE does not give:
  CURVE authenticates a *connection* as a key holder; the MAC authenticates each *message*
  independently of the socket options it came through, so a socket built by mistake without
  CURVE (or a future door, e.g. a relay or a recorded capture replayed into a new connection by
  a misbehaving fleet member) still cannot inject a message an agent acts on; the replay window
  bounds how long any fleet member can re-send a message it once saw. It costs one SHA-256 pass
  over the frames (measured next to CURVE's cost by `macfleet bench f3`, results/security.json).
  Neither layer distinguishes one fleet member from another: the fleet key is shared, so any
  holder can speak for the fleet. Keep it as secret as a password.

A message is signed as `[header, body, *buffers, mac]`, the MAC covering every frame with its
length (so frames cannot be re-split). A verified message is then checked for freshness: its
header's t_ns must lie within the replay window of our clock, and its id must not have been seen
in that window.

A key of None means an open fleet: no CURVE, nothing signed or checked, traffic in clear. Callers
pass None only when the user explicitly asked for one (`--open`).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.utils import z85

from bridge.codec import decode_header
from bridge.errors import AUTH, ProtocolError

log = logging.getLogger(__name__)

KEY_BYTES = 32
MAC_BYTES = 32
DEFAULT_REPLAY_WINDOW_S = 30.0  # covers NTP-level clock skew between Macs
_DOMAIN = b"macfleet-msg-v1\0"
_FLEET_ID_DOMAIN = b"macfleet-fleet-id-v1\0"
OPEN_FLEET_ID = "open"
_CURVE_DOMAIN = b"macfleet-curve-v1\0"
DEFAULT_HANDSHAKE_S = 3.0  # a connection that has not proved the key by then is dropped


@dataclass(frozen=True)
class CurveKeys:
    """The fleet's CURVE keypairs, z85-encoded as libzmq takes them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@lru_cache(maxsize=16)
def curve_keys(key: bytes) -> CurveKeys:
    """Derive both CURVE keypairs from the fleet key (pure, deterministic: one file per Mac)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"fleet key must be {KEY_BYTES} bytes, got {len(key)}")

    def secret(label: bytes) -> bytes:
        return z85.encode(hmac.new(key, _CURVE_DOMAIN + label, hashlib.sha256).digest())

    server, client = secret(b"server"), secret(b"client")
    return CurveKeys(server_public=zmq.curve_public(server), server_secret=server,
                     client_public=zmq.curve_public(client), client_secret=client)


def apply_curve(sock: zmq.Socket, key: bytes | None, *, server: bool,
                handshake_s: float = DEFAULT_HANDSHAKE_S) -> None:
    """Make `sock` a CURVE server or client of the fleet of `key` (before bind/connect).

    No-op for an open fleet (key None). Raises RuntimeError when libzmq lacks CURVE: a closed
    fleet never falls back to clear text.
    """
    if key is None:
        return
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; install a pyzmq wheel that has it "
                           "or run an explicitly --open fleet")
    ck = curve_keys(key)
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_s * 1000)))
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, ck.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, ck.server_public)
    else:
        sock.setsockopt(zmq.CURVE_SECRETKEY, ck.client_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, ck.client_public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, ck.server_public)


def keygen(path: str | os.PathLike[str], *, overwrite: bool = False) -> bytes:
    """Write a new random fleet key (hex) to `path` with mode 0600 and return it.

    Refuses to replace an existing key unless overwrite=True: replacing it locks this Mac out of
    its fleet.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(KEY_BYTES)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    fd = os.open(p, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by umask and ignored for existing files
        os.write(fd, key.hex().encode() + b"\n")
    finally:
        os.close(fd)
    return key


def load_key(path: str | os.PathLike[str]) -> bytes:
    """Read a key written by keygen; ValueError when the file does not hold one."""
    p = Path(path)
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("fleet key %s is readable by others (mode %o); chmod 600 it", p, mode & 0o777)
    text = p.read_text(encoding="ascii").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{p} does not hold a hex fleet key") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"{p}: fleet key must be {KEY_BYTES} bytes, got {len(key)}")
    return key


def fleet_id(key: bytes | None) -> str:
    """A short public name of the fleet (safe for Zeroconf TXT): it reveals nothing of the key."""
    if key is None:
        return OPEN_FLEET_ID
    return hashlib.sha256(_FLEET_ID_DOMAIN + key).hexdigest()[:16]


def mac(frames: Sequence[Any], key: bytes) -> bytes:
    h = hmac.new(key, _DOMAIN, hashlib.sha256)
    for f in frames:
        view = memoryview(f)
        h.update(struct.pack("<Q", view.nbytes))
        h.update(view)
    return h.digest()


def sign(frames: Sequence[Any], key: bytes | None) -> list[Any]:
    """`frames + [mac]`; unchanged (a new list) for an open fleet."""
    if key is None:
        return list(frames)
    return [*frames, mac(frames, key)]


class ReplayGuard:
    """Refuses stale messages and ids already seen within the window.

    Only authenticated messages reach it, so its memory is bounded by what real fleet members
    send in one window. Not thread-safe: one per receiving socket.
    """

    def __init__(self, window_s: float = DEFAULT_REPLAY_WINDOW_S,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.window_ns = int(window_s * 1e9)
        self._clock = clock
        self._seen: set[str] = set()
        self._expiry: list[tuple[int, str]] = []  # heap of (forget after, id)

    def check(self, msg_id: str, t_ns: int) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        if abs(now - t_ns) > self.window_ns:
            raise ProtocolError(AUTH, "message outside the replay window (clock skew or replay)",
                                msg_id=msg_id)
        if msg_id in self._seen:
            raise ProtocolError(AUTH, "replayed message id", msg_id=msg_id)
        self._seen.add(msg_id)
        # Remember it until its timestamp leaves the window; after that the time check refuses it.
        heapq.heappush(self._expiry, (t_ns + self.window_ns, msg_id))

    def __len__(self) -> int:
        return len(self._seen)


def verify(frames: Sequence[Any], key: bytes | None, guard: ReplayGuard | None = None) -> list[Any]:
    """Check the trailing MAC (and freshness, with a guard); return the frames without the MAC.

    Raises ProtocolError("auth") on a missing or wrong MAC, a stale or a replayed message.
    """
    if key is None:
        return list(frames)
    if len(frames) < 2:
        raise ProtocolError(AUTH, "message carries no MAC")
    *payload, tag = frames
    try:
        tag_bytes = bytes(memoryview(tag))
    except TypeError:
        raise ProtocolError(AUTH, "MAC frame is not bytes") from None
    if len(tag_bytes) != MAC_BYTES or not hmac.compare_digest(tag_bytes, mac(payload, key)):
        raise ProtocolError(AUTH, "bad MAC (wrong fleet key, or altered in transit)")
    if guard is not None:
        header = decode_header(payload[0])
        guard.check(header.id, header.t_ns)
    return payload
