"""The fleet key: an HMAC-SHA256 on every multipart message, plus a replay window.

Why HMAC and not ZeroMQ CURVE: CURVE needs a libzmq built with libsodium/tweetnacl support and a
keypair per agent plus a way to distribute and trust public keys. An HMAC with one shared fleet
key works with any pyzmq build, authenticates *every* message (not only the connection), and keeps
array frames zero-copy (the MAC is computed over the buffers where they are; nothing is
re-encoded). What it does not give: confidentiality. Prompts, tokens, probabilities and hidden
states cross the LAN in clear; anyone on the link can read them, but not forge, alter or replay
them within the window. Use a trusted network (or a VPN) when the content is secret.

A message is signed as `[header, body, *buffers, mac]`, the MAC covering every frame with its
length (so frames cannot be re-split). A verified message is then checked for freshness: its
header's t_ns must lie within the replay window of our clock, and its id must not have been seen
in that window. The MAC does not bind the destination: within the window a captured message can
still be replayed once to a *different* agent, so handlers with effects should be idempotent
(e.g. keyed by session id).

A key of None means an open fleet: nothing is signed or checked. Callers pass None only when the
user explicitly asked for an open fleet.
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
from pathlib import Path
from typing import Any, Callable

from bridge.codec import decode_header
from bridge.errors import AUTH, ProtocolError

log = logging.getLogger(__name__)

KEY_BYTES = 32
MAC_BYTES = 32
DEFAULT_REPLAY_WINDOW_S = 30.0  # covers NTP-level clock skew between Macs
_DOMAIN = b"macfleet-msg-v1\0"
_FLEET_ID_DOMAIN = b"macfleet-fleet-id-v1\0"
OPEN_FLEET_ID = "open"


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
