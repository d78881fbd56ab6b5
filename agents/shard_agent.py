"""A shard agent: one rank of a verifier sharded over several Macs, formed from Zeroconf cards.

Every shard agent of a group advertises, in its card, the group name, the group size, its rank
and the TCP port its mlx.distributed ring will listen on. Each one browses until it has seen
all ranks of its group, builds the ring hostfile from their cards (rank order, `host:port`),
and starts the ring itself: no ssh, no launcher, no hostfile written by hand.

Rank 0 then serves as the fleet's verifier (roles `verifier` + `shard`): its VerifierService
drives the spec-decode loop with a `ShardedVerifier`, and proposers talk to it over ZeroMQ as
to any verifier. The other ranks run the follower loop. When a rank dies (the ring raises) or a
link is cut (the watchdog fires after its deadline), rank 0 answers the request in flight with
an `unavailable` error and every surviving rank exits: the fleet sees them leave, and a client
re-plans onto another verifier.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, replace

from agents.daemon import Agent, AgentConfig
from agents.shard import (DEFAULT_DEADLINE_S, DEFAULT_START_DEADLINE_S, EXIT_PEER_LOST,
                          ShardedVerifier, ShardGroup, ShardPeerLost, Watchdog, init_ring)
from bridge.auth import fleet_id
from bridge.card import ROLE_SHARD, ROLE_VERIFIER, AgentCard
from bridge.discovery import ALL_INTERFACES, LOOPBACK_ONLY, Browser

log = logging.getLogger(__name__)

DEFAULT_FORM_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class ShardSpec:
    group: str
    size: int
    rank: int
    mode: str  # tensor | pipeline
    ring_port: int = 0
    deadline_s: float = DEFAULT_DEADLINE_S


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def shard_extra(card: AgentCard) -> dict[str, str]:
    return dict(card.extra)


def hostfile_from_cards(cards: list[AgentCard], spec: ShardSpec,
                        need_ready: bool = False) -> list[list[str]]:
    """Pure: the ring hostfile (one entry per rank) from the group's cards.

    need_ready: every rank must also have announced `ready` (it has seen the whole group).
    """
    by_rank: dict[int, AgentCard] = {}
    for c in cards:
        x = shard_extra(c)
        if x.get("group") == spec.group and x.get("size") == str(spec.size):
            if need_ready and x.get("phase") != "ready":
                continue
            by_rank[int(x["rank"])] = c
    missing = [r for r in range(spec.size) if r not in by_rank]
    if missing:
        raise LookupError(f"shard group {spec.group}: ranks {missing} not "
                          f"{'ready' if need_ready else 'seen'} yet")
    return [[f"{by_rank[r].host}:{shard_extra(by_rank[r])['ring_port']}"]
            for r in range(spec.size)]


class ShardAgent(Agent):
    def __init__(self, cfg: AgentConfig, spec: ShardSpec,
                 form_timeout_s: float = DEFAULT_FORM_TIMEOUT_S) -> None:
        if not 0 <= spec.rank < spec.size:
            raise ValueError(f"rank {spec.rank} is not in a group of {spec.size}")
        if spec.mode not in ("tensor", "pipeline"):
            raise ValueError(f"shard mode must be tensor or pipeline, got {spec.mode}")
        port = spec.ring_port or free_port(cfg.bind_host if cfg.bind_host != "0.0.0.0"
                                           else "127.0.0.1")
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
        wd = Watchdog(DEFAULT_START_DEADLINE_S, self._lost)
        with wd.guard("ring connect"):
            group = init_ring(path, self.spec.rank)
        self.shards = ShardGroup(self.lm.model, group, self.spec.mode, wd)
        self.shards.barrier()
        wd.deadline_s = self.spec.deadline_s
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
        """Two phases, so that all ranks start the ring within moments of each other (MLX's
        ring gives up connecting after ~30 s, and a second init in one process is broken):
        1. wait until every rank's card is seen, then announce `ready`;
        2. wait until every rank is `ready`."""
        interfaces = LOOPBACK_ONLY if self.cfg.loopback_only else ALL_INTERFACES
        with Browser(fleet_id=fleet_id(self.cfg.key), interfaces=interfaces) as b:
            deadline = time.monotonic() + self.form_timeout_s
            self._wait_group(b, deadline, need_ready=False)
            if self.advertiser is not None:
                self.advertiser.update(replace(self.advertiser.card,
                                               extra=self._card_extra("ready")))
            return self._wait_group(b, deadline, need_ready=True)

    def _wait_group(self, browser: Browser, deadline: float, need_ready: bool):
        while True:
            try:
                return hostfile_from_cards(browser.cards(), self.spec, need_ready)
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
        threading.Thread(target=self._exit_soon, daemon=True).start()

    def _exit_soon(self) -> None:
        time.sleep(0.3)  # let the error reply to the client go out
        try:
            if self.advertiser is not None:
                self.advertiser.close()
        finally:
            os._exit(EXIT_PEER_LOST)
