"""The pure part of discovery: browsed cards keyed by node id, and the events they produce.

No sockets, no zeroconf: `bridge.discovery.Browser` feeds it what it resolves (under its lock)
and tests drive it directly with a clock of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from bridge.card import AgentCard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CardAdded:
    card: AgentCard
    at: float  # Browser clock (time.monotonic by default)


@dataclass(frozen=True)
class CardUpdated:
    card: AgentCard
    previous: AgentCard
    at: float


@dataclass(frozen=True)
class CardRemoved:
    """The agent said goodbye (or its records expired). Never sent for a crashed agent."""
    card: AgentCard
    at: float


DiscoveryEvent = CardAdded | CardUpdated | CardRemoved


@dataclass(frozen=True)
class Sighting:
    """A card and when it was first and last announced (announcements, not liveness)."""
    card: AgentCard
    service: str  # the DNS-SD instance name it came under
    first_seen: float
    last_seen: float


class Roster:
    """Pure bookkeeping of browsed cards keyed by node id; not thread-safe (Browser locks it).

    Node id, not service name, is the identity: an instance renamed on a name conflict (``-2``)
    is the same agent, and a stale service name later expiring must not remove the node that a
    newer service now carries.
    """

    def __init__(self, fleet_id: str | None = None) -> None:
        self._fleet_id = fleet_id
        self._by_node: dict[str, Sighting] = {}
        self._node_of: dict[str, str] = {}  # service name -> node id

    def keeps(self, card: AgentCard) -> bool:
        """Whether the card is of the fleet this roster keeps."""
        return self._fleet_id is None or card.fleet_id == self._fleet_id

    def observe(self, service: str, card: AgentCard, now: float) -> list[DiscoveryEvent]:
        if self._fleet_id is not None and card.fleet_id != self._fleet_id:
            log.debug("ignoring %s: fleet %s, not %s", service, card.fleet_id, self._fleet_id)
            return self.forget(service, now)
        events: list[DiscoveryEvent] = []
        if self._node_of.get(service, card.node_id) != card.node_id:
            events += self.forget(service, now)  # the service now speaks for another node
        self._node_of[service] = card.node_id
        seen = self._by_node.get(card.node_id)
        if seen is None:
            self._by_node[card.node_id] = Sighting(card, service, now, now)
            return events + [CardAdded(card, now)]
        self._by_node[card.node_id] = Sighting(card, service, seen.first_seen, now)
        if seen.card == card:
            return events
        return events + [CardUpdated(card, seen.card, now)]

    def forget(self, service: str, now: float) -> list[DiscoveryEvent]:
        node_id = self._node_of.pop(service, None)
        seen = self._by_node.get(node_id) if node_id is not None else None
        if seen is None or seen.service != service:
            return []
        del self._by_node[seen.card.node_id]
        return [CardRemoved(seen.card, now)]

    def sightings(self) -> list[Sighting]:
        return sorted(self._by_node.values(), key=lambda s: (s.card.name, s.card.node_id))

    def cards(self) -> list[AgentCard]:
        return [s.card for s in self.sightings()]


def nodes_present(*node_ids: str) -> Callable[[list[AgentCard]], bool]:
    """A ``Browser.wait_for`` predicate: every one of ``node_ids`` has been seen."""
    wanted = frozenset(node_ids)
    return lambda cards: wanted <= {c.node_id for c in cards}
