"""The fleet key and ZeroMQ CURVE: every socket of a closed fleet is encrypted and authenticated.

One 32-byte fleet key, copied to every Mac, is the only secret. `curve_keys` derives from it a
server keypair (ROUTER and PUB sockets) and a client keypair (DEALER and SUB sockets): each
secret is HMAC-SHA256(fleet key, label) taken as a Curve25519 scalar (libsodium clamps it), the
public half computed by `zmq.curve_public`. What each key proves:
- the server keypair: a client that completes the handshake knows it talks to a holder of the
  fleet key (only a holder can derive the server secret and open the client's HELLO);
- the client keypair: `bridge.zap` admits to a server socket only the client public key the
  fleet key derives, and CURVE's INITIATE proves the client holds its secret half. So the server
  *public* key is not a password: a peer that learnt it (it is never published: Zeroconf TXT
  carries only `fleet_id`, a hash) but holds another client keypair is refused at the
  handshake, and libzmq closes the connection before one byte reaches the application. An unauthenticated peer gets nothing back:
no typed error, no echo. Connections that never finish the handshake are dropped after
`DEFAULT_HANDSHAKE_S` (`zmq.HANDSHAKE_IVL`), so idle floods cannot hold file descriptors, and
`bridge.peercap` caps how many connections one address holds meanwhile (key holders too).

Why there is no per-message HMAC and replay window any more (there were, before CURVE):
- CURVE already authenticates every frame (Poly1305 under per-connection short-term keys) and
  numbers them (nonces), so nothing can be forged, altered, re-ordered or replayed by anyone
  without the key, and a capture cannot be replayed into another connection (its short-term
  keys die with it).
- Against a fleet member neither layer helps: the key is shared, so any holder can sign a fresh
  message as easily as replay an old one. Per-member identity would need per-Mac keys.
- The one thing a MAC would still catch, a socket built without CURVE by mistake, is ruled out
  structurally instead: every fleet socket is made by `bridge.sockets._socket`, which applies
  CURVE whenever there is a key (and refuses to fall back to clear text), and a test checks no
  other module creates ZeroMQ sockets.
- It was not free: signing and verifying a 16 MiB message took 19-26 ms here, about half of
  what CURVE itself adds at that size, and more than CURVE below 1 MiB (`macfleet bench
  security`, results/security.json, `hmac_ms` next to `extra_ms`).

A key of None means an open fleet: no CURVE, traffic in clear, anyone who can reach the port is
served. Callers pass None only when the user explicitly asked for one (`--open`).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from functools import lru_cache

import zmq
from zmq.utils import z85

KEY_BYTES = 32
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
        from bridge import zap  # not at the top: bridge.zap imports nothing of ours, but keep
        # the handler thread out of processes that never serve

        zap.admit(sock.context, zap_domain(key), frozenset({z85.decode(ck.client_public)}))
        sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain(key).encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, ck.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, ck.server_public)
    else:
        sock.setsockopt(zmq.CURVE_SECRETKEY, ck.client_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, ck.client_public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, ck.server_public)


def zap_domain(key: bytes) -> str:
    """The ZAP domain of a fleet's server sockets (public, like the fleet id it is made of)."""
    return f"macfleet-{fleet_id(key)}"


def fleet_id(key: bytes | None) -> str:
    """A short public name of the fleet (safe for Zeroconf TXT): it reveals nothing of the key."""
    if key is None:
        return OPEN_FLEET_ID
    return hashlib.sha256(_FLEET_ID_DOMAIN + key).hexdigest()[:16]


_CARD_DOMAIN = b"macfleet-card-v2\0"
CARD_SIG = "sig"  # the AgentCard.extra entry (TXT "x-sig") carrying the card's tag
CARD_STAMP = "ts"  # the AgentCard.extra entry (TXT "x-ts"): when the tag was made, Unix seconds


def card_tag(key: bytes, fleet: str, node_id: str, host: str, router_port: int,
             pub_port: int, stamp: int) -> str:
    """An HMAC of where an agent says it listens and when it said so, under the fleet key
    (pure): a card whose tag checks was advertised by a key holder for exactly that address,
    at `stamp` (`bridge.peers` refuses stale stamps, so a recorded card cannot be replayed
    for long once its agent is gone). 128 bits, hex: public, it proves and reveals nothing
    else."""
    msg = "\0".join((fleet, node_id, host.lower(), str(int(router_port)), str(int(pub_port)),
                     str(int(stamp))))
    return hmac.new(key, _CARD_DOMAIN + msg.encode(), hashlib.sha256).hexdigest()[:32]
