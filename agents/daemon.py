"""The agent daemon: one per Mac. Advertise, serve a role, publish metrics, never die of input
(its life cycle: docs/agents.md, "daemon.py").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace

from bridge.auth import fleet_id
from bridge.card import (AHEAD_KIND, CARD_DRAFT, ROLE_PREFILL, ROLE_PROPOSER, ROLE_SHARD,
                         ROLE_VERIFIER, AgentCard, draft_label)
from bridge.discovery import ALL_INTERFACES, LOOPBACK_ONLY, Advertiser
from bridge.errors import BAD_REQUEST, BUSY, INTERNAL, ProtocolError
from bridge.peers import PeerAllowlist, signed
from bridge.messages import (AgentEvent, BatchStatusRequest, ErrorReply, HiddenStates,
                             HiddenStatesAck, Ping, Pong, PresetResult, RunPreset, StatusReply,
                             StatusRequest)
from agents.specs import PROPOSER_KINDS
from bridge.transport import Publisher, Server
from macfleet import sysinfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    role: str
    model: str = "smollm2"
    name: str = ""
    bind_host: str = "127.0.0.1"  # "0.0.0.0" on a LAN
    port: int = 0
    pub_port: int = 0
    key: bytes | None = None
    loopback_only: bool = True
    proposer_kinds: tuple[str, ...] = PROPOSER_KINDS
    heads_dir: str | None = None  # draft heads a proposer may load by name (besides shipped)
    f3_codec: str = "float16"  # verifier: how hidden states travel to a remote drafter
    cpu: int | None = None
    advertise: bool = True
    node_id: str = ""
    f3_probe: bool = False  # verifier: measure F3 with a hidden-state-sized probe per block
    allow_hub: bool = False  # remote requests may name Hugging Face ids (downloads) for draft:
    # verifier: ship long prompts' prefill to prefill agents when it pays (a DisaggPolicy;
    # None: never)
    disagg: object | None = None
    # pre-handshake connections per peer address (None: bridge.peercap's default, 0: no caps)
    max_conns_per_peer: int | None = None
    # verifier (None: VerifierLimits' default): sessions in one batched forward (0: one at a
    # time), the batch's stall ratio, a remote draft's timeout
    batch_sessions: int | None = None
    stall_ratio: float | None = None
    draft_timeout_s: float | None = None
    # endpoints a request may make this agent connect to besides the fleet members it
    # discovered (bridge.peers, --allow-peer)
    allow_peers: tuple[str, ...] = ()
    # proposer: a draft model that drafts ahead for `model`'s verifiers (draft_service.py);
    # the agent then loads only the draft model
    draft: str | None = None


def raise_fd_limit(target: int = 65536) -> int:
    """Raise the soft open-files limit toward the hard one (each ZeroMQ peer costs an fd);
    returns the soft limit now in force."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit to %d: %s", want, e)
    return soft


def pin_to_cpu(cpu: int | None) -> None:
    """Pin this process to one core (Linux), so two agents on one machine do not fight."""
    if cpu is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        log.warning("--cpu is not supported on this platform; ignoring")
        return
    os.sched_setaffinity(0, {cpu})


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        if cfg.role not in (ROLE_PROPOSER, ROLE_VERIFIER, ROLE_SHARD, ROLE_PREFILL):
            raise ValueError(f"role must be {ROLE_PROPOSER}, {ROLE_VERIFIER}, {ROLE_SHARD} or "
                             f"{ROLE_PREFILL}, got {cfg.role}")
        self.cfg = cfg
        self.node_id = cfg.node_id or uuid.uuid4().hex[:12]
        self.name = cfg.name or f"{socket.gethostname().split('.')[0]}-{cfg.role}"
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._tool_lock = threading.Lock()
        self.fd_limit = raise_fd_limit()
        pin_to_cpu(cfg.cpu)
        from agents.admission import admit
        from macfleet.engine.models import load_model

        if cfg.draft and cfg.role != ROLE_PROPOSER:
            raise ValueError("--draft names a proposer agent's draft model")
        loads = cfg.draft or cfg.model  # a draft-model agent needs only the draft model
        admit(loads, sysinfo.memory_free())  # AdmissionError: not loaded

        self.lm = load_model(loads)
        self.publisher = Publisher(key=cfg.key, bind=f"tcp://{cfg.bind_host}:{cfg.pub_port or '*'}",
                                   max_per_peer=cfg.max_conns_per_peer)
        self.proposer = self.verifier = self.prefill = self._browser = None
        if cfg.advertise or cfg.disagg is not None:  # fleet members, for bridge.peers
            from bridge.discovery import Browser

            self._browser = Browser(fleet_id=fleet_id(cfg.key), interfaces=(
                LOOPBACK_ONLY if cfg.loopback_only else ALL_INTERFACES),
                accept=lambda c: signed(c, cfg.key))  # no forged card displaces a member's
        b = self._browser
        self.peers = PeerAllowlist(cfg.key, cfg.allow_peers,
                                   cards=b.cards if b else lambda: (),
                                   wait_for=b.wait_for if b else None)
        self._start_services()
        self.server = Server(self._handle, key=cfg.key, max_per_peer=cfg.max_conns_per_peer,
                             bind=f"tcp://{cfg.bind_host}:{cfg.port or '*'}").start()
        self.card = self._make_card()
        self.warmed = self._warm()
        self.advertiser = None
        if cfg.advertise:
            self.advertiser = Advertiser(
                self.card, interfaces=LOOPBACK_ONLY if cfg.loopback_only else ALL_INTERFACES,
                key=cfg.key)
            self.card = self.advertiser.card
        self._after_advertise()
        self.publish(AgentEvent(self.node_id, "join", f"{self.name} up ({cfg.role})", time.time()))

    def _start_services(self) -> None:
        """The role's services (a hook: a shard agent starts its own after forming the group)."""
        if self.cfg.role == ROLE_PROPOSER and self.cfg.draft:
            from agents.draft_service import DraftAheadService

            self.proposer = DraftAheadService(self.lm, serves=self.cfg.model)
        elif self.cfg.role == ROLE_PROPOSER:
            from agents.proposer_service import ProposerService

            self.proposer = ProposerService(self.lm, kinds=self.cfg.proposer_kinds,
                                            heads_dir=self.cfg.heads_dir,
                                            allow_hub=self.cfg.allow_hub)
        elif self.cfg.role == ROLE_PREFILL:
            from agents.prefill_service import PrefillService

            self.prefill = PrefillService(self.lm)
        else:
            self.verifier = self._verifier_service()

    def _verifier_service(self, verifier=None, on_fatal=None):
        from agents.specs import SpecPolicy
        from agents.verifier_service import VerifierLimits, VerifierService

        policy = SpecPolicy(heads_dir=self.cfg.heads_dir, own_model=self.lm.spec,
                            allow_hub=self.cfg.allow_hub, vocab_size=self.lm.vocab_size)
        given = {k: getattr(self.cfg, k) for k in ("batch_sessions", "stall_ratio",
                                                   "draft_timeout_s")
                 if getattr(self.cfg, k) is not None}
        endpoints = None
        if self.cfg.disagg is not None and verifier is None:
            endpoints = self._prefill_endpoints
        return VerifierService(self.lm, node_id=self.node_id, key=self.cfg.key,
                               limits=VerifierLimits(**given),
                               publish=self.publish, f3_probe=self.cfg.f3_probe,
                               verifier=verifier, on_fatal=on_fatal, f3_codec=self.cfg.f3_codec,
                               policy=policy, prefill_endpoints=endpoints,
                               disagg=self.cfg.disagg, peers=self.peers.check)

    def _prefill_endpoints(self) -> list[str]:
        """Prefill agents of this fleet serving this model, as Zeroconf shows them now (only
        cards whose tag checks under the fleet key: bridge.peers)."""
        return [c.router_endpoint for c in self._browser.cards()
                if ROLE_PREFILL in c.roles and self.lm.spec in c.models
                and signed(c, self.cfg.key)]

    def _warm(self):
        """Before the card goes out: what each role's first request would pay (agents/warmup.py)."""
        from agents import warmup

        if self.verifier is not None and self.cfg.role == ROLE_VERIFIER:
            w = warmup.warm_verifier(self.lm)
        elif self.proposer is not None and self.cfg.draft:  # the draft model's first steps
            w = warmup.warm_draft(self.lm)
        elif self.proposer is not None:
            w = warmup.warm_proposer(self.lm, self.cfg.proposer_kinds)
        else:
            return None
        log.info("warm in %.1f s: %s", w.seconds, w)
        return w

    def _after_advertise(self) -> None:
        """A hook run once the agent is discoverable."""

    def _make_card(self) -> AgentCard:
        host = self.cfg.bind_host if self.cfg.bind_host not in ("0.0.0.0", "*") else ""
        return AgentCard(
            extra=self._card_extra(),
            node_id=self.node_id, name=self.name, fleet_id=fleet_id(self.cfg.key), host=host,
            router_port=self.server.port, pub_port=self.publisher.port, roles=(self.cfg.role,),
            chip=sysinfo.chip()[:60], mem_total=sysinfo.memory_total(),
            mem_free=sysinfo.memory_free() // 2**26 * 2**26,
            models=(self.cfg.model if self.cfg.draft else self.lm.spec,),
            proposers=(() if self.cfg.role != ROLE_PROPOSER else
                       (AHEAD_KIND,) if self.cfg.draft else self.cfg.proposer_kinds),
        )

    def _card_extra(self) -> tuple[tuple[str, str], ...]:
        if self.cfg.draft:  # what it drafts with, for `ls` and the client's default drafter
            return ((CARD_DRAFT, draft_label(self.cfg.draft)),)
        return ()

    def publish(self, msg) -> None:
        try:
            self.publisher.publish(msg)
        except Exception:  # metrics are best effort; a PUB failure must not stop generation
            log.exception("publish failed")

    @property
    def sessions(self) -> int:
        if self.proposer is not None:
            return self.proposer.sessions
        if self.prefill is not None:
            return self.prefill.sessions
        return self.verifier.active if self.verifier is not None else 0

    def _handle(self, env, reply) -> None:
        msg = env.msg
        if isinstance(msg, Ping):
            reply(Pong(msg.seq, msg.sent_ns, self.node_id))
            return
        if isinstance(msg, StatusRequest):
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
            reply(StatusReply(card=self.card, sessions=self.sessions,
                              uptime_s=time.monotonic() - self.started, load=load,
                              mem_used=sysinfo.memory_total() - sysinfo.memory_free(),
                              rss=sysinfo.rss_bytes()))
            return
        if isinstance(msg, BatchStatusRequest) and self.verifier is not None:
            reply(self.verifier.batch_status(msg.recent))
            return
        if isinstance(msg, HiddenStates) and self.proposer is None:
            # link probes reach every role; a proposer service acks (and may use) its own
            reply(HiddenStatesAck(msg.session_id, msg.block, int(msg.states.nbytes)))
            return
        if isinstance(msg, RunPreset):
            self._run_preset(msg, reply)
            return
        for svc in (self.proposer, self.verifier, self.prefill):
            if svc is not None and svc.handle(msg, reply):
                return
        raise ProtocolError(BAD_REQUEST,
                            f"a {self.cfg.role} agent does not serve '{type(msg).__name__}'")

    def _run_preset(self, msg, reply) -> None:
        """Validate now (typed error at once), measure on a worker thread, one at a time."""
        from agents.presets import peers_named, validate

        preset, params = validate(msg.preset, dict(msg.params))
        self.peers.check(peers_named(preset, params))  # forbidden before any connection
        if self.sessions:
            raise ProtocolError(BUSY, "sessions are running: a benchmark now would measure "
                                      "both badly; try again when idle")
        if not self._tool_lock.acquire(blocking=False):
            raise ProtocolError(BUSY, "another preset is running")

        def work() -> None:
            try:
                result = preset.run(self, params)
                result.update(host=self.name, chip=self.card.chip, preset=preset.name,
                              params=params, measured_at=time.time())
                answer = PresetResult(preset.name, json.dumps(result))
            except Exception as e:  # the daemon never dies of a request; the error goes back
                log.exception("preset %s failed", preset.name)
                answer = ErrorReply(INTERNAL, f"{preset.name}: {type(e).__name__}: {e}")
            finally:
                self._tool_lock.release()  # before replying: the next request may follow at once
            reply(answer)

        threading.Thread(target=work, name=f"preset-{preset.name}", daemon=True).start()

    def refresh_card(self) -> None:
        """Re-announce when what the card says changed (free memory, quantised to 64 MiB) or
        its tag is due to be re-signed (bridge.peers: tags go stale)."""
        if self.advertiser is None:
            return
        new = replace(self.advertiser.card, mem_free=sysinfo.memory_free() // 2**26 * 2**26)
        self.advertiser.update(new)
        self.card = self.advertiser.card

    def serve_forever(self, card_refresh_s: float = 15.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        while not self._stop.wait(card_refresh_s):
            self.refresh_card()
        self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.publish(AgentEvent(self.node_id, "leave", f"{self.name} down", time.time()))
        if self.advertiser is not None:
            self.advertiser.close()  # waits, so the goodbyes go out
        self.server.close()
        for svc in (self.proposer, self.verifier, self.prefill):
            if svc is not None:
                svc.close()
        if self._browser is not None:
            self._browser.close()
        self.publisher.close()
