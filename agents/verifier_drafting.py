"""Where a verifier agent's drafts come from, request by request.

Named proposer endpoints draft a chain on the first that answers (`FallbackProposer`: the next
takes over when one fails) or an `a+b` tree on all at once (`RemoteProposerGroup`); without
endpoints this agent's own drafters do, `auto` by the chooser over them (engine/choosing.py).
Remote hidden-state drafters get this verifier's hidden states (F3), tapped or batch-fed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from agents.remote_proposer import DEFAULT_DRAFT_TIMEOUT_S, FlowTotals, RemoteProposer
from agents.remote_stream import StreamingProposer
from agents.remote_tree import RemoteProposerGroup
from agents.specs import DraftModels, SpecPolicy, make_checked_proposer
from bridge.card import AHEAD_KIND
from bridge.messages import AUTO_DRAFT_TOKENS, GenerateRequest
from macfleet.engine.controller import AUTO, DraftTokens
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers.base import Draft, Proposer, ProposerFailed
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.proposers.group import make_group, tree_budget
from macfleet.engine.text import Drafting, no_drafts, plan_drafting
from macfleet.stats import BlockFlows, FlowStats

log = logging.getLogger(__name__)


class FallbackProposer(Proposer):
    """Remote proposers in order of preference; the first that fails is dropped for the next."""

    def __init__(self, proposers: Sequence[RemoteProposer]) -> None:
        self.remotes = list(proposers)  # every proposer it was given, live or dropped
        self._live = list(proposers)
        self.paced = bool(self.remotes) and all(p.paced for p in self.remotes)
        self.failures: list[str] = []
        self.name = self._live[0].spec if self._live else "none"

    @property
    def current(self) -> RemoteProposer | None:
        return self._live[0] if self._live else None

    @property
    def wants_features(self) -> bool:
        return any(p.wants_features for p in self.remotes)

    def feature_rows(self, n: int):
        """The endpoints share one feature source: its rows 0..n-1 (None unless all held)."""
        return self._live[0].feature_rows(n) if self._live else None

    def feed_features(self, start: int, tokens, hidden) -> None:
        """The endpoints share one feature source: fed once."""
        if self._live:
            self._live[0].feed_features(start, tokens, hidden)

    def start(self, params: SamplingParams = GREEDY) -> None:
        self.params = params
        for p in self._live:
            p.start(params)

    def _first(self, call):
        """`call` on the first live proposer; one that fails is dropped for the next."""
        while self._live:
            try:
                return call(self._live[0])
            except ProposerFailed as e:
                self._drop(e)
        raise ProposerFailed("no proposer left; continuing with plain decoding")

    def propose(self, context, k: int) -> Draft:
        return self._first(lambda p: p.propose(context, k))

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        if self._live:  # the drafter on the other Mac learns from what became of its draft
            self._live[0].observe(drafted, accepted, verify_ms, verified)

    def begin(self, context, k: int) -> None:
        """Send the request to the first live proposer (dropping those that cannot take it)."""
        self._begun = (list(context), k)
        self._first(lambda p: p.begin(context, k))

    def finish(self) -> Draft:
        """Its reply; when that proposer fails now, the next ones are asked in turn."""
        try:
            return self._live[0].finish()
        except ProposerFailed as e:
            self._drop(e)
        return self.propose(*self._begun)

    def _drop(self, e: ProposerFailed) -> None:
        p = self._live.pop(0)
        log.warning("proposer %s failed: %s", p.endpoint, e)
        self.failures.append(f"{p.endpoint}: {e}")
        p.close()

    def close(self) -> None:
        for p in self._live:
            p.close()

    def flow_stats(self) -> FlowStats:
        """Per-block flows over every remote block, whichever proposer drafted it (and, from
        a draft-model agent drafting ahead, its lead, waste and the verifier's wait)."""
        totals = FlowTotals()
        for p in self.remotes:
            totals += p.flows
        s = totals.summary(f3_probe=probed(self))
        ahead = [p.flow_stats() for p in self.remotes
                 if isinstance(p, StreamingProposer) and p.flows.blocks]
        if ahead:
            n = sum(a.remote_blocks for a in ahead)
            s = replace(s, **{f: sum(getattr(a, f) * a.remote_blocks for a in ahead) / n
                              for f in ("ahead_lead", "ahead_waste", "ahead_wait_ms",
                                        "ahead_token_ms")})
        return s


def draft_tokens_of(msg: GenerateRequest) -> DraftTokens:
    """The engine's draft length named by a request (its wire form is an int)."""
    return AUTO if msg.draft_tokens == AUTO_DRAFT_TOKENS else msg.draft_tokens


def last_flows(proposer) -> BlockFlows | None:
    """Flow figures of the block just verified (the slowest proposer's, for a tree)."""
    if isinstance(proposer, FallbackProposer):
        return proposer.current.flows.last if proposer.current else None
    if isinstance(proposer, RemoteProposerGroup):
        lasts = [p.flows.last for p, live in zip(proposer.proposers, proposer.live)
                 if live and isinstance(p, RemoteProposer) and p.flows.last]
        if not lasts:
            return None
        worst = max(lasts, key=lambda f: f.wire_ms)
        return replace(worst, f1_bytes=sum(f.f1_bytes for f in lasts),
                       f2_bytes=sum(f.f2_bytes for f in lasts))
    return None


def probed(drafter) -> bool:
    """Whether a drafter's F3 figures are a probe's: one of its remote proposers sends one
    (a hidden-state drafter fed this verifier's real features sends none)."""
    return isinstance(drafter, (FallbackProposer, RemoteProposerGroup)) and \
        any(p.f3_probe_width for p in drafter.remotes)


class RequestDrafting:
    """Builds each request's drafter for one verifier (its model, key, spec policy and F3
    settings); `feature_tap` is the hidden-state tap of the one-session generation running."""

    def __init__(self, lm: LoadedModel, *, key: bytes | None, policy: SpecPolicy,
                 models: DraftModels, verifier, f3_probe_width: int = 0,
                 f3_codec: str = "float16",
                 draft_timeout_s: float = DEFAULT_DRAFT_TIMEOUT_S) -> None:
        self.lm = lm
        self.key = key
        self.policy = policy
        self.models = models
        self._verifier = verifier
        self.f3_probe_width = f3_probe_width
        self.f3_codec = f3_codec
        self.draft_timeout_s = draft_timeout_s
        self.feature_tap = None

    def close_tap(self) -> None:
        if self.feature_tap is not None:
            self.feature_tap.close()
            self.feature_tap = None

    def drafting(self, msg: GenerateRequest, batched: bool = False) -> Drafting:
        """What drafts for this request (docs/agents.md, "verifier_drafting.py"), tree or chain
        as in-process (engine/text.py plan_drafting). batched: a continuous batch's session
        (hidden-state drafters fed its rows by the batch engine, not tapped)."""
        spec = msg.proposer_spec or "none"
        if spec == AUTO and not msg.proposers:  # chosen here, per request (engine/choosing.py)
            from macfleet.engine.choosing import make_auto_group

            spec = self.auto_spec()
            if spec == AUTO:
                return make_auto_group(self.lm, draft_tokens_of(msg))
        if msg.proposers:
            return plan_drafting(spec, chain=lambda s: self.fallback(msg, batched),
                                 tree=lambda specs: self.tree_group(msg, specs, batched))

        def make(s: str) -> Proposer | None:
            return make_checked_proposer(s, self.lm, self.policy, self.models)

        return plan_drafting(spec, chain=make, tree=lambda specs: make_group(
            [make(s) or no_drafts(s) for s in specs], draft_tokens_of(msg)))

    def auto_spec(self) -> str:
        """What `auto` drafts with here: the chooser (engine/choosing.py `auto_spec`), or n-gram
        chains on a sharded verifier (no KV cache here to verify a tree in)."""
        from macfleet.engine.choosing import auto_spec
        from macfleet.engine.proposers.choice import FALLBACK

        return auto_spec(self.lm) if hasattr(self._verifier, "cache") else FALLBACK

    def fallback(self, msg: GenerateRequest, batched: bool = False) -> FallbackProposer:
        """One chain drafter on the named endpoints, in order of preference (`draft` alone:
        draft-model agents drafting ahead, each with the draft model its operator named)."""
        if msg.proposer_spec == AHEAD_KIND:  # `draft` alone (remote requests name no model)
            return FallbackProposer([StreamingProposer(ep, key=self.key, model=self.lm.spec)
                                     for ep in msg.proposers])
        feats = self.features(msg.proposer_spec, batched)
        return FallbackProposer([self._remote(msg, ep, msg.proposer_spec, feats)
                                 for ep in msg.proposers])

    def _remote(self, msg: GenerateRequest, endpoint: str, spec: str, feats) -> RemoteProposer:
        """A drafter on another agent: sent this verifier's hidden states `feats`, or else F3
        probed when this verifier measures it."""
        return RemoteProposer(endpoint, key=self.key, proposer=spec, model=self.lm.spec,
                              cross_round=msg.cross_round,
                              f3_probe_width=self.f3_probe_width if feats is None else 0,
                              features=feats, f3_codec=self.f3_codec,
                              draft_timeout_s=self.draft_timeout_s)

    def features(self, spec: str, batched: bool = False):
        """Real F3 for a remote hidden-state drafter: tap this verifier's own forwards (one
        session at a time), or take the rows the batch engine feeds this session."""
        if not spec.startswith("eagle"):
            return None
        from macfleet.engine.proposers.eagle.chain import VerifierFeatures

        if batched:
            return VerifierFeatures(self.lm.model, tap=False)
        if not hasattr(self._verifier, "cache"):
            return None
        self.feature_tap = VerifierFeatures(self.lm.model)
        return self.feature_tap

    def tree_group(self, msg: GenerateRequest, specs: list[str],
                    batched: bool = False) -> RemoteProposerGroup:
        """`a+b+c` with N endpoints: proposer i drafts spec i (the last spec repeats)."""
        spec_of = [specs[min(i, len(specs) - 1)] for i in range(len(msg.proposers))]
        feats = next((self.features(s, batched) for s in spec_of if s.startswith("eagle")),
                     None)
        remotes = [self._remote(msg, ep, spec, feats if spec.startswith("eagle") else None)
                   for ep, spec in zip(msg.proposers, spec_of)]
        return RemoteProposerGroup(remotes, draft_tokens=draft_tokens_of(msg),
                                   node_budget=tree_budget(remotes))
