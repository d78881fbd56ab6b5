"""The control-plane client: discovered agents -> statuses; generation through a verifier.

Everything goes through `bridge` (Zeroconf + ZeroMQ); nothing here imports the engine.
`generate` is what the CLI uses: fleet-level events (`Text`, `Done`) and fleet-level errors
(`VerifierFailed`, `Refused`), so no wire message or wire error reaches a command.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from bridge.auth import fleet_id as fleet_id  # discovery filters on a key's fleet id
from bridge.card import AHEAD_KIND, ROLE_PROPOSER, ROLE_VERIFIER, AgentCard
from bridge.discovery import ALL_INTERFACES, LOOPBACK_ONLY, Browser
from bridge.errors import (FORBIDDEN, INTERNAL, UNAVAILABLE, PeerUnavailable, ProtocolError,
                           TransportTimeout)
from bridge.peers import signed
from bridge.messages import (AUTO_DRAFT_TOKENS, BatchStatus, BatchStatusRequest, GenerateChunk,
                             GenerateDone, GenerateRequest, Ping, Pong, StatusReply,
                             StatusRequest)
from bridge.transport import Client
from macfleet.engine.controller import AUTO, DraftTokens
from macfleet.stats import FleetStats, GenerationStats

DEFAULT_DISCOVER_S = 3.0
DEFAULT_STATUS_TIMEOUT_S = 2.0
DEFAULT_PINGS = 3
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 120.0  # the verifier may be busy with queued generations
# a verifier agent heartbeats every request it holds each second (agents.verifier_service):
# silent this long, it is dead (killed, asleep, cut off)
DEFAULT_SILENCE_S = 3.0
DEFAULT_REPLANS = 2  # other verifiers tried after the first one fails mid-request


class NoFleet(RuntimeError):
    """No usable agents were found (the message says what was seen; `seen` counts them)."""

    def __init__(self, message: str, seen: int = 0) -> None:
        super().__init__(message)
        self.seen = seen


@dataclass(frozen=True)
class AgentStatus:
    card: AgentCard
    status: StatusReply | None
    rtt_ms: tuple[float, ...]
    error: str = ""

    @property
    def alive(self) -> bool:
        return self.status is not None

    @property
    def rtt_p50_ms(self) -> float | None:
        if not self.rtt_ms:
            return None
        s = sorted(self.rtt_ms)
        return s[len(s) // 2]


def discover(fleet_id: str | None, *, loopback: bool = False, wait_s: float = DEFAULT_DISCOVER_S,
             expect: int = 0) -> list[AgentCard]:
    """Cards seen within wait_s (returns early once `expect` agents are seen), unchecked: for
    listing what is advertised; a client that connects uses `members`."""
    return _browse(fleet_id, None, loopback, wait_s, expect)


def members(key: bytes | None, *, loopback: bool = False, wait_s: float = DEFAULT_DISCOVER_S,
            expect: int = 0) -> list[AgentCard]:
    """The cards of the fleet of `key` whose tag checks (`bridge.peers.signed`: the fleet key
    signed this very address and ports, recently), seen within wait_s (early once `expect`
    are). The agents check the same, so a card that fails here is one no agent connects to
    either: forged, replayed at another address or port, or stale. Nothing connects to a
    card before this check."""
    return _browse(fleet_id(key), lambda c: signed(c, key), loopback, wait_s, expect)


def _browse(fid: str | None, accept, loopback: bool, wait_s: float,
            expect: int) -> list[AgentCard]:
    with Browser(fleet_id=fid, interfaces=LOOPBACK_ONLY if loopback else ALL_INTERFACES,
                 accept=accept) as b:
        if expect:
            try:
                return b.wait_for(lambda cs: len(cs) >= expect, wait_s)
            except TimeoutError:
                return b.cards()
        time.sleep(wait_s)
        return b.cards()


def probe(card: AgentCard, key: bytes | None, *, pings: int = DEFAULT_PINGS,
          timeout: float = DEFAULT_STATUS_TIMEOUT_S) -> AgentStatus:
    """Ping an agent a few times (RTT) and ask its status; never raises for a dead agent."""
    rtts: list[float] = []
    try:
        with Client(card.router_endpoint, key=key, connect_timeout_s=timeout) as c:
            for seq in range(pings):
                t = time.perf_counter_ns()
                r = c.request(Ping(seq, t), timeout=timeout)
                if isinstance(r, Pong):
                    rtts.append((time.perf_counter_ns() - t) / 1e6)
            st = c.request(StatusRequest(), timeout=timeout)
        return AgentStatus(card, st if isinstance(st, StatusReply) else None, tuple(rtts))
    except (ProtocolError, TransportTimeout, PeerUnavailable) as e:
        return AgentStatus(card, None, tuple(rtts), str(e))


def batch_status(card: AgentCard, key: bytes | None, *, recent: int = 32,
                 timeout: float = DEFAULT_STATUS_TIMEOUT_S) -> BatchStatus | None:
    """A verifier agent's continuous batch; None when it cannot be read (dead, older agent)."""
    try:
        with Client(card.router_endpoint, key=key, connect_timeout_s=timeout) as c:
            r = c.request(BatchStatusRequest(recent), timeout=timeout)
        return r if isinstance(r, BatchStatus) else None
    except (ProtocolError, TransportTimeout, PeerUnavailable):
        return None


def choose_roles(statuses: Sequence[AgentStatus], model: str | None = None
                 ) -> tuple[AgentStatus, list[AgentStatus]]:
    """The verifier (alive, serving the model, lowest load) and the live proposers for it."""
    def serves(s: AgentStatus) -> bool:
        return model is None or model in s.card.models

    verifiers = [s for s in statuses if s.alive and ROLE_VERIFIER in s.card.roles and serves(s)]
    if not verifiers:
        seen = ", ".join(f"{s.card.name}({'/'.join(s.card.roles)}, "
                         f"{'up' if s.alive else 'down: ' + s.error})" for s in statuses)
        raise NoFleet(f"no live verifier{' for ' + model if model else ''} in the fleet; "
                      f"saw {seen or 'no agents'}", seen=len(statuses))
    v = min(verifiers, key=lambda s: (s.status.sessions, s.rtt_p50_ms or 0.0))
    props = [s for s in statuses if s.alive and ROLE_PROPOSER in s.card.roles
             and any(m in s.card.models for m in v.card.models)]
    props.sort(key=lambda s: (s.status.sessions, s.rtt_p50_ms or 0.0))
    return v, props


def drafting_for(spec: str, proposers: Sequence[AgentStatus], *, draft_agents: bool
                 ) -> tuple[str, list[AgentStatus]]:
    """The drafter spec a request names and the proposer agents that draft it (pure): the
    verifier's draft-model agents (`agent --draft MODEL`, drafting ahead) with spec `draft`
    when `draft_agents` (the user asked for `auto` or `draft`) and the fleet has any; else
    `spec` on the other proposer agents (a draft-model agent serves no other drafter);
    `auto` on none: the verifier agent chooses among its own drafters (engine/choosing.py)."""
    ahead = [p for p in proposers if p.card.draft_model]
    if draft_agents and ahead:
        return AHEAD_KIND, ahead
    if spec == AUTO:
        return AUTO, []
    return spec, [p for p in proposers if not p.card.draft_model]


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def generate_remote(verifier: AgentCard, key: bytes | None, *, prompt: str, chat: bool = True,
                    max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                    seed: int | None = None, draft_tokens: DraftTokens = AUTO,
                    proposers: Sequence[str] = (), proposer_spec: str = "ngram",
                    cross_round: bool = True,
                    first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                    prefix_ids: Sequence[int] = (),
                    silence_s: float = DEFAULT_SILENCE_S,
                    top_logprobs: int | None = None,
                    grammar: tuple[str, str] = ("", ""),
                    cache_partition: str = "", prediction: Sequence[int] = ()
                    ) -> Iterator[GenerateChunk | GenerateDone]:
    """Stream a generation from a verifier agent. Raises ProtocolError/TransportTimeout.

    PeerUnavailable at once when the verifier's process dies (its connection drops);
    TransportTimeout when the verifier is silent (no chunk, no heartbeat) for silence_s, or
    sends no token within first_token_timeout_s. Heartbeats (empty chunks) are not yielded.
    prefix_ids: tokens a failed verifier already committed for this request (re-planning).
    top_logprobs: each chunk carries its tokens' logprobs and this many alternatives.
    grammar: (kind, source) the answer must match (engine/constraint.py's kinds; "" none).
    cache_partition: whose prompt cache on the verifier (serve's API key partition).
    prediction: token ids of the answer the client expects (drafted from, never imposed).
    """
    req = GenerateRequest(request_id=new_request_id(), prompt=prompt, chat=chat,
                          max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          draft_tokens=AUTO_DRAFT_TOKENS if draft_tokens == AUTO
                          else int(draft_tokens), proposers=list(proposers),
                          proposer_spec=proposer_spec, cross_round=cross_round,
                          prefix_ids=tuple(int(t) for t in prefix_ids),
                          top_logprobs=top_logprobs, grammar_kind=grammar[0],
                          grammar_source=grammar[1], cache_partition=cache_partition,
                          prediction_ids=tuple(int(t) for t in prediction))
    first_by = time.monotonic() + first_token_timeout_s
    first = True
    with Client(verifier.router_endpoint, key=key, watch_peer=True) as c:
        for msg in c.stream(req, timeout_per_msg=min(silence_s, first_token_timeout_s)):
            if isinstance(msg, GenerateChunk) and not msg.token_ids and not msg.text:
                if first and time.monotonic() > first_by:
                    raise TransportTimeout(f"no token from {verifier.name} within "
                                           f"{first_token_timeout_s:.0f}s (it is alive but busy)")
                continue  # a heartbeat
            first = False
            yield msg


# --- generation as fleet-level events (what the CLI sees) ---------------------------------------


@dataclass(frozen=True)
class Placed:
    """The agents chosen for the request (first, and again after each re-plan): what the CLI
    tells the user about where it runs."""

    fleet_id: str
    verifier: AgentCard
    proposers: tuple[AgentCard, ...]


@dataclass(frozen=True)
class Text:
    """Tokens the verifier committed, and their text."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Done:
    """The end of one verifier's answer: its text (with the detokenizer's final flush), ids and
    the typed stats, with where it ran filled in."""

    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats


@dataclass(frozen=True)
class Replanned:
    """The verifier failed mid-request (why); the rest of the fleet takes over after the tokens
    already received."""

    why: str


class VerifierFailed(RuntimeError):
    """The verifier died, went silent or broke mid-request: re-plan on the rest of the fleet."""


class Refused(RuntimeError):
    """The verifier refused the request itself (a bad argument): asking another will not help.
    code: the wire error's (bridge.errors), e.g. "forbidden" for a proposer it may not reach."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ProposerRefused:
    """The verifier refused to connect to a proposer (why); the answer goes on without it."""

    why: str


_NAMED_ENDPOINT = re.compile(r"'(tcp://[^']+)' is not an agent of this fleet")


def refused_endpoint(message: str) -> str | None:
    """The proposer endpoint a verifier's forbidden error names (bridge.peers.check), or None."""
    m = _NAMED_ENDPOINT.search(message)
    return m[1] if m else None


def verifier_and_proposer(cards: Sequence[AgentCard]) -> tuple[AgentCard, AgentCard]:
    """The first verifier and the first proposer among cards (a local fleet's pair)."""
    return (next(c for c in cards if ROLE_VERIFIER in c.roles),
            next(c for c in cards if ROLE_PROPOSER in c.roles))


def generate(verifier: AgentCard, key: bytes | None, *, proposers: Sequence[AgentCard] = (),
             proposer_spec: str = "ngram", **request) -> Iterator[Text | Done]:
    """`generate_remote` as fleet-level events; one proposer agent drafts several `+` branches
    (a session each) when there are fewer agents than branches. request: generate_remote's
    keywords (prompt, chat, max_tokens, temperature, top_p, seed, draft_tokens, cross_round,
    prefix_ids, top_logprobs, grammar)."""
    remote = [p.router_endpoint for p in proposers] if proposer_spec != "none" else []
    n_specs = len(proposer_spec.split("+"))
    if remote and len(remote) < n_specs:
        remote = [remote[i % len(remote)] for i in range(n_specs)]
    try:
        for msg in generate_remote(verifier, key, proposers=remote, proposer_spec=proposer_spec,
                                   **request):
            if isinstance(msg, GenerateChunk):
                yield Text(tuple(msg.token_ids), msg.text)
            elif isinstance(msg, GenerateDone):
                fleet = msg.stats.fleet or FleetStats(verifier=verifier.node_id)
                stats = replace(msg.stats, fleet=replace(
                    fleet, verifier_agent=verifier.name,
                    proposer_agents=tuple(p.name for p in proposers) if remote else ()))
                yield Done(msg.text, tuple(msg.token_ids), stats)
    except ProtocolError as e:
        if e.code in (UNAVAILABLE, INTERNAL):
            raise VerifierFailed(f"verifier {verifier.name}: {e}") from None
        raise Refused(f"verifier {verifier.name}: {e}", e.code) from None
    except (TransportTimeout, PeerUnavailable) as e:
        raise VerifierFailed(f"verifier {verifier.name}: {e}") from None


def generate_with(verifier: AgentCard, key: bytes | None, proposers: Sequence[AgentCard],
                  **request) -> Iterator[Text | Done | ProposerRefused]:
    """`generate`, where a proposer the verifier refuses to reach ("forbidden": it does not
    see that card as a member of the fleet) costs the answer that proposer's drafts, never the
    answer: the request goes again without it (a refusal comes before any token), then without
    any remote proposer when the error names none."""
    proposers = list(proposers)
    while True:
        try:
            yield from generate(verifier, key, proposers=proposers, **request)
            return
        except Refused as e:
            if e.code != FORBIDDEN or not proposers:
                raise
            named = refused_endpoint(str(e))
            keep = [p for p in proposers if p.router_endpoint != named] if named else []
            if len(keep) == len(proposers):
                keep = []
            proposers = keep
            yield ProposerRefused(f"{e}; going on without "
                                  f"{named or 'remote proposers'}")


def generate_fleet(key: bytes | None, model: str | None, *, wait_s: float = DEFAULT_DISCOVER_S,
                   replans: int = DEFAULT_REPLANS, proposer_spec: str = "ngram",
                   draft_agents: bool = False, **request
                   ) -> Iterator[Placed | Text | Done | Replanned | ProposerRefused]:
    """One generation through the fleet: discover, pick the verifier and its proposers
    (`choose_roles`), stream; when the verifier is lost, re-plan without it and continue after
    the tokens already received (a grammar, `grammar=(kind, source)`, resumes after them too:
    the new verifier's constraint advances over them before decoding). `Done` carries the
    whole answer across verifiers. `Placed` names the agents before each verifier's first token.

    Only cards whose tag checks are used (`members`): nothing connects to a forged or
    replayed card. A proposer the verifier refuses costs its drafts (`generate_with`).
    Raises NoFleet when no verifier is found at first (the caller may generate in-process),
    VerifierFailed when none could finish, Refused when the request itself is refused.
    request: `generate`'s keywords but prefix_ids.
    """
    failed: set[str] = set()
    ids: list[int] = []
    texts: list[str] = []
    for attempt in range(replans + 1):
        cards = [c for c in members(key, wait_s=wait_s, expect=2)
                 if c.node_id not in failed]
        statuses = [probe(c, key, pings=1) for c in cards]
        try:
            verifier, proposers = choose_roles(statuses, model)
            spec, proposers = drafting_for(proposer_spec, proposers, draft_agents=draft_agents)
        except NoFleet as e:
            if attempt:
                raise VerifierFailed(f"{e} (after the verifier failed)") from None
            raise
        prior_text = "".join(texts)
        yield Placed(fleet_id(key), verifier.card, tuple(p.card for p in proposers))
        try:
            for ev in generate_with(verifier.card, key, [p.card for p in proposers],
                                    proposer_spec=spec, prefix_ids=list(ids), **request):
                if isinstance(ev, ProposerRefused):
                    yield ev
                elif isinstance(ev, Text):
                    ids.extend(ev.token_ids)
                    texts.append(ev.text)
                    yield ev
                elif isinstance(ev, Done):
                    # this verifier's full text (with its detokenizer's final flush) after what
                    # an earlier, failed verifier had already sent
                    yield Done(prior_text + ev.text, tuple(ids), ev.stats)
            return
        except VerifierFailed as e:
            failed.add(verifier.card.node_id)
            yield Replanned(str(e))
    raise VerifierFailed("no verifier could finish the generation")
