"""A shard agent: one rank of a verifier sharded over several Macs, formed from Zeroconf cards.

Each rank advertises its group, size, rank and ring port; once every rank's card is seen and
confirmed over CURVE, the ring starts from them. Rank 0 serves as the fleet's verifier
(`ShardedVerifier`), the others follow; when a rank dies every survivor leaves the fleet
(docs/agents.md, "shard_agent.py").
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, replace

from agents.daemon import Agent, AgentConfig
from agents.shard import (DEFAULT_DEADLINE_S, EXIT_PEER_LOST, SHARD_MODES, ShardedVerifier,
                          ShardGroup, ShardPeerLost, free_ports, start_group)
from bridge.auth import fleet_id
from bridge.card import ROLE_SHARD, ROLE_VERIFIER, AgentCard
from bridge.discovery import ALL_INTERFACES, LOOPBACK_ONLY, Browser

log = logging.getLogger(__name__)

DEFAULT_FORM_TIMEOUT_S = 90.0
DEFAULT_CONFIRM_TIMEOUT_S = 3.0
READY_REBROWSE_S = 1.5  # phase 2: a group not all ready this long is browsed afresh
# answering (Zeroconf, CURVE) this long after the group is ready, before the ring's connect
# holds the process: a slower rank still learns this one is ready
RING_GRACE_S = 5.0


@dataclass(frozen=True)
class ShardSpec:
    group: str
    size: int
    rank: int
    mode: str  # tensor | pipeline | expert
    ring_port: int = 0
    deadline_s: float = DEFAULT_DEADLINE_S


def group_cards(cards: list[AgentCard], spec: ShardSpec,
                need_ready: bool = False) -> list[AgentCard]:
    """Pure: one card per rank of the group, in rank order (LookupError while ranks miss).

    need_ready: every rank must also have announced `ready` (it has seen the whole group).
    """
    by_rank: dict[int, AgentCard] = {}
    for c in cards:
        x = dict(c.extra)
        if x.get("group") == spec.group and x.get("size") == str(spec.size):
            if need_ready and x.get("phase") != "ready":
                continue
            by_rank[int(x["rank"])] = c
    missing = [r for r in range(spec.size) if r not in by_rank]
    if missing:
        raise LookupError(f"shard group {spec.group}: ranks {missing} not "
                          f"{'ready' if need_ready else 'seen'} yet")
    return [by_rank[r] for r in range(spec.size)]


_RING_FIELDS = ("group", "size", "rank", "ring_port")


def _ring_identity(c: AgentCard) -> tuple:
    x = dict(c.extra)
    return (c.node_id, c.host, c.router_port, *(x.get(f) for f in _RING_FIELDS))


def confirm_cards(cards: list[AgentCard], key: bytes | None,
                  timeout_s: float = DEFAULT_CONFIRM_TIMEOUT_S) -> list[AgentCard]:
    """Each rank's card confirmed by its agent over CURVE before a ring is built from it
    (Zeroconf is unauthenticated): its StatusReply card must name the same node and ring
    fields; LookupError names the rank that could not be confirmed."""
    from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
    from bridge.messages import StatusReply, StatusRequest
    from bridge.transport import Client

    for c in cards:
        try:
            with Client(c.router_endpoint, key=key, connect_timeout_s=timeout_s) as cl:
                st = cl.request(StatusRequest(), timeout=timeout_s)
        except (PeerUnavailable, TransportTimeout, ProtocolError) as e:
            raise LookupError(f"card of {c.name} ({c.router_endpoint}) not confirmed by a "
                              f"fleet member: {e}") from None
        said, mine = dict(st.card.extra) if isinstance(st, StatusReply) else {}, dict(c.extra)
        if not isinstance(st, StatusReply) or st.card.node_id != c.node_id or any(
                said.get(f) != mine.get(f) for f in _RING_FIELDS):
            raise LookupError(f"card of {c.name} ({c.router_endpoint}) differs from what the "
                              "agent there says: not building a ring from it")
    return cards


class ShardAgent(Agent):
    def __init__(self, cfg: AgentConfig, spec: ShardSpec,
                 form_timeout_s: float = DEFAULT_FORM_TIMEOUT_S) -> None:
        if not 0 <= spec.rank < spec.size:
            raise ValueError(f"rank {spec.rank} is not in a group of {spec.size}")
        if spec.mode not in SHARD_MODES:
            raise ValueError(f"shard mode must be one of {SHARD_MODES}, got {spec.mode}")
        port = spec.ring_port or free_ports(1, cfg.bind_host if cfg.bind_host != "0.0.0.0"
                                            else "127.0.0.1")[0]
        self.spec = replace(spec, ring_port=port)
        self.form_timeout_s = form_timeout_s
        self.shards: ShardGroup | None = None
        super().__init__(replace(cfg, role=ROLE_SHARD))

    def _card_extra(self, phase: str = "forming") -> tuple[tuple[str, str], ...]:
        s = self.spec
        return (("group", s.group), ("size", str(s.size)), ("rank", str(s.rank)),
                ("ring_port", str(s.ring_port)), ("mode", s.mode), ("phase", phase))

    def _start_services(self) -> None:
        pass  # nothing to serve until the group has formed

    def _after_advertise(self) -> None:
        hosts = self._discover_group()
        path = os.path.join(tempfile.mkdtemp(prefix="macfleet-ring-"), "hosts.json")
        with open(path, "w") as f:
            json.dump(hosts, f)
        self.shards = start_group(self.lm.model, path, self.spec.rank, self.spec.mode, self._lost,
                                  self.spec.deadline_s)
        log.info("shard rank %d/%d ready (%s)", self.spec.rank, self.spec.size, self.spec.mode)
        if self.spec.rank == 0:
            self.verifier = self._verifier_service(ShardedVerifier(self.shards),
                                                   on_fatal=self._lost)
            if self.advertiser is not None:
                card = replace(self.advertiser.card, roles=(ROLE_VERIFIER, ROLE_SHARD),
                               extra=self._card_extra("serving"))
                self.advertiser.update(card)
                self.card = self.advertiser.card
        else:
            threading.Thread(target=self._follow, name="shard-follower", daemon=True).start()

    def _discover_group(self) -> list[list[str]]:
        """Two phases, so that all ranks start the ring within moments of each other: every card
        seen and confirmed, then every rank `ready` (docs/agents.md, "shard_agent.py")."""
        interfaces = LOOPBACK_ONLY if self.cfg.loopback_only else ALL_INTERFACES
        with Browser(fleet_id=fleet_id(self.cfg.key), interfaces=interfaces) as b:
            deadline = time.monotonic() + self.form_timeout_s
            seen = self._wait_group(b, deadline, need_ready=False)
            # before `ready`: no rank may be inside the ring's connect while another asks it
            confirm_cards(seen, self.cfg.key)
            if self.advertiser is not None:
                self.advertiser.update(replace(self.advertiser.card,
                                               extra=self._card_extra("ready")))
            ready = self._wait_ready(b, deadline, interfaces)
        for a, c in zip(seen, ready):
            if _ring_identity(a) != _ring_identity(c):
                raise LookupError(f"card of rank {dict(c.extra).get('rank')} changed after it "
                                  "was confirmed: not building a ring from it")
        time.sleep(RING_GRACE_S)
        return [[f"{c.host}:{dict(c.extra)['ring_port']}"] for c in ready]

    def _wait_ready(self, browser: Browser, deadline: float, interfaces) -> list[AgentCard]:
        """Phase 2; a peer `ready` may stay `forming` in one browser's cache, so after
        READY_REBROWSE_S without the whole group ready, look again with a fresh browser."""
        look = browser
        try:
            while True:
                try:
                    return self._wait_group(
                        look, min(deadline, time.monotonic() + READY_REBROWSE_S), need_ready=True)
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
                if look is not browser:
                    look.close()
                log.info("shard rank %d: the group is not all ready yet: browsing again",
                         self.spec.rank)
                look = Browser(fleet_id=fleet_id(self.cfg.key), interfaces=interfaces)
        finally:
            if look is not browser:
                look.close()

    def _wait_group(self, browser: Browser, deadline: float, need_ready: bool):
        while True:
            try:
                return group_cards(browser.cards(), self.spec, need_ready)
            except LookupError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{e} within {self.form_timeout_s:.0f}s") from None
            time.sleep(0.1)

    def _follow(self) -> None:
        try:
            self.shards.serve()
        except ShardPeerLost as e:
            self._lost(str(e))
        self.stop()

    def _lost(self, why: str) -> None:
        """The group is broken: say so, leave the fleet, exit (a ring cannot be re-formed)."""
        log.error("shard rank %d: %s; leaving", self.spec.rank, why)
        if self.verifier is not None:  # requests in flight hear why, not silence
            self.verifier.fail_pending(why)
        threading.Thread(target=self._exit_soon, daemon=True).start()

    def _exit_soon(self) -> None:
        time.sleep(0.3)  # let the error reply to the client go out
        try:
            if self.advertiser is not None:
                self.advertiser.close()
        finally:
            os._exit(EXIT_PEER_LOST)
