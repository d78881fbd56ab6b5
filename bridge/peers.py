"""Which endpoints an agent connects to on a request's word: its own fleet's, nobody else's.

A GenerateRequest names proposer endpoints and a `link_probe` preset names a peer; without a
check the agent would connect (and send its CURVE greeting) to any `tcp://` address a key holder
names, inside networks the sender cannot reach itself (SSRF). So every such endpoint must be

- the ROUTER of an agent this agent discovered on Zeroconf whose card carries a valid, fresh
  tag (`bridge.auth.card_tag`: an HMAC of its fleet, node, host, ports and a time stamp under
  the fleet key, so only a key holder can advertise an address; a card copied to another
  address or port fails, and a recorded card replayed more than `DEFAULT_CARD_MAX_AGE_S` after
  it was signed fails too: advertisers re-sign every `resign_after_s`), or
- allowed by the agent's operator on its command line (`--allow-peer tcp://HOST:PORT`, or
  `tcp://HOST:*` for every port of a host);

anything else is refused with `ProtocolError(forbidden)` before any connection is made.
Clients (`macfleet.fleet.client`) apply the same `signed` check to every card before they
connect to it at all: a card that fails it is never probed, pinged or named as a proposer.
`check` and `signed_endpoints` are pure; `PeerAllowlist` joins them to a live card source.
"""

from __future__ import annotations

import contextlib
import hmac
import re
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from bridge.auth import CARD_SIG, CARD_STAMP, OPEN_FLEET_ID, card_tag, fleet_id
from bridge.card import AgentCard
from bridge.errors import FORBIDDEN, ProtocolError

ANY_PORT = "*"
# A card's tag holds for this long after it was signed (wall clock: Macs keep theirs by NTP),
# give or take DEFAULT_CLOCK_SKEW_S between the signer's clock and the checker's. Advertisers
# re-sign every third of it, so a live agent's card is never stale; a recorded one is, soon.
# Read at call time: tests patch them.
DEFAULT_CARD_MAX_AGE_S = 900.0
DEFAULT_CLOCK_SKEW_S = 120.0
_ENDPOINT = re.compile(r"tcp://([0-9A-Za-z.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):(\d{1,5}|\*)")


def parse(endpoint: str) -> tuple[str, str] | None:
    """(host lower-cased, port or '*') of a `tcp://HOST:PORT` endpoint; None otherwise."""
    m = _ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if m is None or (m[2] != ANY_PORT and not 0 < int(m[2]) < 65536):
        return None
    return m[1].lower(), m[2] if m[2] == ANY_PORT else str(int(m[2]))


def allowed(endpoint: str, operator: Collection[str], discovered: Collection[str]) -> bool:
    """Whether `endpoint` is a discovered fleet member's or one the operator allowed (pure)."""
    ep = parse(endpoint)
    if ep is None or ep[1] == ANY_PORT:
        return False
    for rule in (*operator, *discovered):
        r = parse(rule)
        if r is not None and r[0] == ep[0] and r[1] in (ep[1], ANY_PORT):
            return True
    return False


def check(endpoints: Sequence[str], operator: Collection[str],
          discovered: Collection[str]) -> None:
    """ProtocolError(forbidden) naming the first endpoint that is not allowed (pure)."""
    for e in endpoints:
        if not allowed(e, operator, discovered):
            raise ProtocolError(FORBIDDEN, f"{str(e)[:80]!r} is not an agent of this fleet: "
                                           "an agent connects only to fleet members it "
                                           "discovered or to peers its operator allowed "
                                           "(--allow-peer)")


def stamp_of(card: AgentCard) -> int | None:
    """When the card's tag was made (Unix seconds), None when it carries no stamp."""
    raw = dict(card.extra).get(CARD_STAMP, "")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 12 else None


def fresh(stamp: int, now: float) -> bool:
    """Whether a tag made at `stamp` still holds at `now` (pure)."""
    return -DEFAULT_CLOCK_SKEW_S <= now - stamp <= DEFAULT_CARD_MAX_AGE_S + DEFAULT_CLOCK_SKEW_S


def resign_after_s() -> float:
    """How often an advertiser re-signs its card (a third of the tag's life)."""
    return DEFAULT_CARD_MAX_AGE_S / 3


def signed(card: AgentCard, key: bytes | None, now: float | None = None) -> bool:
    """Whether a discovered card is a member's: its tag checks under the fleet key for its
    address, ports and stamp, and the stamp is fresh at `now` (default: the wall clock). An
    open fleet has no key: any card of the open fleet id counts."""
    if card.fleet_id != fleet_id(key):
        return False
    if key is None:
        return card.fleet_id == OPEN_FLEET_ID
    stamp = stamp_of(card)
    if stamp is None or not fresh(stamp, time.time() if now is None else now):
        return False
    tag = dict(card.extra).get(CARD_SIG, "")
    want = card_tag(key, card.fleet_id, card.node_id, card.host, card.router_port,
                    card.pub_port, stamp)
    return hmac.compare_digest(tag.encode(), want.encode())


def sign(card: AgentCard, key: bytes | None, stamp: int | None = None) -> AgentCard:
    """The card with its tag and stamp (default: now) among its extras (unchanged for an open
    fleet)."""
    if key is None:
        return card
    from dataclasses import replace

    stamp = int(time.time()) if stamp is None else int(stamp)
    tag = card_tag(key, card.fleet_id, card.node_id, card.host, card.router_port, card.pub_port,
                   stamp)
    return replace(card, extra=(*((k, v) for k, v in card.extra
                                  if k not in (CARD_SIG, CARD_STAMP)),
                                (CARD_STAMP, str(stamp)), (CARD_SIG, tag)))


def signed_endpoints(cards: Iterable[AgentCard], key: bytes | None) -> set[str]:
    """ROUTER endpoints of the cards that are fleet members' (pure)."""
    return {c.router_endpoint for c in cards if signed(c, key)}


DEFAULT_SETTLE_S = 5.0  # a browser this young may not have heard every member yet


class PeerAllowlist:
    """The operator's rules and a live source of discovered cards (a Browser's `cards`).

    wait_for: a Browser's `wait_for`; while the browser is younger than `settle_s`, an endpoint
    not yet discovered is waited for until then (a fleet started together: a client may see a
    proposer's card a moment before this agent does). Afterwards a miss is refused at once."""

    def __init__(self, key: bytes | None, operator: Sequence[str] = (),
                 cards: Callable[[], Iterable[AgentCard]] = lambda: (),
                 wait_for: Callable[..., object] | None = None,
                 settle_s: float = DEFAULT_SETTLE_S) -> None:
        bad = [r for r in operator if parse(r) is None]
        if bad:
            raise ValueError(f"--allow-peer takes tcp://HOST:PORT or tcp://HOST:*, got {bad}")
        self.key = key
        self.operator = tuple(operator)
        self._cards = cards
        self._wait_for = wait_for
        self._settle_until = time.monotonic() + settle_s

    def discovered(self) -> set[str]:
        return signed_endpoints(self._cards(), self.key)

    def check(self, endpoints: Sequence[str]) -> None:
        if not endpoints:
            return
        try:
            check(endpoints, self.operator, self.discovered())
        except ProtocolError:
            left = self._settle_until - time.monotonic()
            if self._wait_for is None or left <= 0:
                raise
            with contextlib.suppress(TimeoutError):
                self._wait_for(lambda cards: all(
                    allowed(e, self.operator, signed_endpoints(cards, self.key))
                    for e in endpoints), left)
            check(endpoints, self.operator, self.discovered())
