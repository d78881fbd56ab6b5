"""AgentCard <-> DNS-SD records: TXT properties (round-trip tested), instance and host names.

A TXT record is a list of ``key=value`` strings of at most 255 bytes each (RFC 6763 §6.1), read
by anyone on the LAN. So the codec here:

- never writes a secret: only the card's public fields, and extras whose key looks like a
  credential are refused outright;
- keeps every entry within 255 bytes: identity fields (node id, fleet id) are refused when too
  long, since a cut id would silently name another node; free text (name, chip) is cut on a UTF-8
  boundary; lists (roles, models, proposers) lose whole trailing items, and the record then says
  which lists were cut (``trunc=models,...``) so a client knows to ask the agent's status reply
  for the full list;
- refuses records it cannot trust with one ``ValueError`` subclass naming the key at fault.

The address is not in the TXT record: it comes from the A records the browser resolved, which is
the address that actually answered on the network.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence

from bridge.card import PROTOCOL_VERSION, AgentCard

TXT_ENTRY_MAX = 255  # bytes per "key=value" entry, RFC 6763 §6.1
LABEL_MAX = 63  # bytes in one DNS label (instance name, host name)

K_PROTOCOL = "proto"
K_FLEET = "fleet"
K_NODE = "node"
K_NAME = "name"
K_ROLES = "roles"
K_CHIP = "chip"
K_MEM_TOTAL = "mem"
K_MEM_FREE = "free"
K_MODELS = "models"
K_PROPOSERS = "props"
K_ROUTER = "router"
K_PUB = "pub"
K_TRUNCATED = "trunc"
EXTRA_PREFIX = "x-"
# Extras surface which lists the sender cut, under this key of AgentCard.extra.
EXTRA_TRUNCATED = "txt_truncated"

_REQUIRED = (K_PROTOCOL, K_FLEET, K_NODE, K_ROUTER, K_PUB)
_RESERVED = frozenset(
    {K_PROTOCOL, K_FLEET, K_NODE, K_NAME, K_ROLES, K_CHIP, K_MEM_TOTAL, K_MEM_FREE, K_MODELS,
     K_PROPOSERS, K_ROUTER, K_PUB, K_TRUNCATED}
)
# A cheap safety net: TXT is broadcast in clear, so an extra named like a credential is a bug.
_SECRET_HINTS = ("secret", "password", "passwd", "private", "api_key", "fleet_key", "apikey")


class TxtRecordError(ValueError):
    """A TXT record that cannot be turned into an AgentCard (missing, garbled, too long)."""


class TxtProtocolError(TxtRecordError):
    """A well-formed record from an agent speaking another protocol version."""

    def __init__(self, message: str, *, protocol: int) -> None:
        super().__init__(message)
        self.protocol = protocol


def _room(key: str) -> int:
    """Bytes left for a value under ``key`` within one TXT entry."""
    return TXT_ENTRY_MAX - len(key.encode()) - 1


def _cut_text(key: str, value: str) -> str:
    """Cut free text to fit its entry, never splitting a UTF-8 sequence."""
    raw = value.encode()
    room = _room(key)
    if len(raw) <= room:
        return value
    return raw[:room].decode("utf-8", errors="ignore")


def _join_list(key: str, items: tuple[str, ...]) -> tuple[str, bool]:
    """Comma-join items, dropping whole trailing items that do not fit; returns (value, cut)."""
    room = _room(key)
    kept: list[str] = []
    used = 0
    for item in items:
        if not item or "," in item:
            raise ValueError(f"{key}: list item {item!r} is empty or contains a comma")
        cost = len(item.encode()) + (1 if kept else 0)
        if used + cost > room:
            return ",".join(kept), True
        kept.append(item)
        used += cost
    return ",".join(kept), False


def _require_fits(key: str, value: str) -> str:
    if not value:
        raise ValueError(f"{key}: must not be empty")
    if len(value.encode()) > _room(key):
        raise ValueError(f"{key}: {len(value.encode())} bytes do not fit one TXT entry "
                         f"({_room(key)} max); identities are never truncated")
    return value


def card_to_txt(card: AgentCard) -> dict[str, str]:
    """TXT properties advertising ``card`` (everything but the host, which A records carry).

    Raises ValueError for cards that cannot be advertised faithfully: an id too long for an entry,
    a list item with a comma, an extra that collides with a reserved key or looks like a secret.
    """
    props: dict[str, str] = {
        K_PROTOCOL: str(card.protocol),
        K_FLEET: _require_fits(K_FLEET, card.fleet_id),
        K_NODE: _require_fits(K_NODE, card.node_id),
        K_NAME: _cut_text(K_NAME, card.name),
        K_CHIP: _cut_text(K_CHIP, card.chip),
        K_MEM_TOTAL: str(card.mem_total),
        K_MEM_FREE: str(card.mem_free),
        K_ROUTER: str(card.router_port),
        K_PUB: str(card.pub_port),
    }
    cut: list[str] = []
    lists = ((K_ROLES, card.roles), (K_MODELS, card.models), (K_PROPOSERS, card.proposers))
    for key, items in lists:
        props[key], was_cut = _join_list(key, items)
        if was_cut:
            cut.append(key)
    if cut:
        props[K_TRUNCATED] = ",".join(cut)
    for name, value in card.extra:
        if name == EXTRA_TRUNCATED:
            continue  # recomputed above, never forwarded
        lowered = name.lower()
        if any(hint in lowered for hint in _SECRET_HINTS):
            raise ValueError(f"extra {name!r} looks like a secret; TXT records are public")
        key = EXTRA_PREFIX + name
        if not name or "=" in name or key in props:
            raise ValueError(f"extra {name!r}: empty, contains '=' or repeats a key")
        if len(key.encode()) >= TXT_ENTRY_MAX:
            raise ValueError(f"extra {name!r}: key too long for a TXT entry")
        props[key] = _cut_text(key, value)
    return props


def _text(props: Mapping[bytes, bytes | None], key: str, *, required: bool) -> str | None:
    raw = props.get(key.encode())
    if raw is None:
        if required:
            state = "has no value" if key.encode() in props else "is missing"
            raise TxtRecordError(f"TXT key {key!r} {state}")
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TxtRecordError(f"TXT key {key!r} is not UTF-8: {raw[:40]!r}") from exc


def _int(props: Mapping[bytes, bytes | None], key: str, *, required: bool, low: int = 0,
         high: int | None = None) -> int:
    text = _text(props, key, required=required)
    if text is None:
        return 0
    if not text.isascii() or not text.isdigit():
        raise TxtRecordError(f"TXT key {key!r} is not a non-negative integer: {text[:40]!r}")
    value = int(text)
    if value < low or (high is not None and value > high):
        raise TxtRecordError(f"TXT key {key!r}={value} outside [{low}, {high}]")
    return value


def _list(props: Mapping[bytes, bytes | None], key: str) -> tuple[str, ...]:
    text = _text(props, key, required=False)
    return tuple(item for item in text.split(",") if item) if text else ()


def card_from_txt(props: Mapping[bytes, bytes | None], *, address: str) -> AgentCard:
    """The AgentCard a TXT record describes, reachable at ``address`` (from the A records).

    Raises TxtProtocolError for another protocol version and TxtRecordError for anything missing
    or garbled; unknown keys are ignored so newer agents can add fields.
    """
    if not address:
        raise TxtRecordError("no address resolved for this record")
    protocol = _int(props, K_PROTOCOL, required=True)
    if protocol != PROTOCOL_VERSION:
        raise TxtProtocolError(
            f"agent speaks protocol {protocol}, this side speaks {PROTOCOL_VERSION}",
            protocol=protocol,
        )
    node_id = _text(props, K_NODE, required=True) or ""
    fleet_id = _text(props, K_FLEET, required=True) or ""
    if not node_id or not fleet_id:
        raise TxtRecordError(f"TXT keys {K_NODE!r} and {K_FLEET!r} must not be empty")
    extra: list[tuple[str, str]] = []
    for raw_key in props:
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TxtRecordError(f"TXT key {raw_key[:40]!r} is not UTF-8") from exc
        if key.startswith(EXTRA_PREFIX):
            extra.append((key[len(EXTRA_PREFIX):], _text(props, key, required=False) or ""))
    truncated = _text(props, K_TRUNCATED, required=False)
    if truncated:
        extra.append((EXTRA_TRUNCATED, truncated))
    return AgentCard(
        node_id=node_id,
        name=_text(props, K_NAME, required=False) or "",
        fleet_id=fleet_id,
        host=address,
        router_port=_int(props, K_ROUTER, required=True, low=1, high=65535),
        pub_port=_int(props, K_PUB, required=True, low=1, high=65535),
        roles=_list(props, K_ROLES),
        chip=_text(props, K_CHIP, required=False) or "",
        mem_total=_int(props, K_MEM_TOTAL, required=False),
        mem_free=_int(props, K_MEM_FREE, required=False),
        models=_list(props, K_MODELS),
        proposers=_list(props, K_PROPOSERS),
        protocol=protocol,
        extra=tuple(extra),
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-")


def instance_name(card: AgentCard) -> str:
    """``<name>-<node id>`` as one DNS label: the node id keeps it unique, so it is never cut;
    the human name is cut to make room."""
    node = _slug(card.node_id)[:LABEL_MAX] or "node"
    room = LABEL_MAX - len(node) - 1
    name = _slug(card.name)[:room].strip("-") if room > 0 else ""
    return f"{name}-{node}" if name else node


def server_name(card: AgentCard) -> str:
    """The SRV target host name, one per agent so several agents can share a machine."""
    return f"macfleet-{_slug(card.node_id)[:LABEL_MAX - 9] or 'node'}.local."


def pick_address(addresses: Sequence[str]) -> str:
    """The resolved address to connect to: routable first, then link-local (a Thunderbolt
    bridge), loopback last; "" when there is none."""
    ranked = sorted((ip.is_loopback, ip.is_link_local, str(ip))
                    for ip in map(ipaddress.ip_address, addresses))
    return ranked[0][2] if ranked else ""


def txt_bytes(props: Mapping[str, str]) -> dict[bytes, bytes | None]:
    """The properties as a browser receives them (bytes), for tests and for local loopback."""
    return {key.encode(): value.encode() for key, value in props.items()}
