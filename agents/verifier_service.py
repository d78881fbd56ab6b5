"""The verifier role: owns generation sessions and drives the spec-decode loop.

A client's GenerateRequest names the proposer agents to use (ZeroMQ endpoints, in order of
preference). The loop runs on this agent's compute thread with a `FallbackProposer` in place of
a local proposer: when one proposer dies or stalls, the next one takes over; when none is left,
decoding goes on plainly. Tokens stream back as GenerateChunk messages; per-block metrics go
out on the agent's PUB socket (BlockMetrics) for `macfleet dash`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from agents.remote_proposer import FlowTotals, RemoteProposer
from agents.remote_tree import RemoteProposerGroup
from agents.shard_traffic import block_delta
from agents.specs import (MAX_SPEC_CHARS, DraftModels, SpecPolicy, check_id, check_spec,
                          make_checked_proposer)
from bridge.errors import BAD_REQUEST, BUSY, INTERNAL, UNAVAILABLE, ProtocolError
from bridge.peers import PeerAllowlist
from bridge.messages import (AUTO_DRAFT_TOKENS, BatchStatus, BlockMetrics, ErrorReply,
                             GenerateChunk, GenerateDone, GenerateRequest)
from macfleet.engine.controller import AUTO, MAX_DRAFT_TOKENS, DraftTokens
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.kvship import PrefilledVerifier, model_layout
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import ProposerSpecError, parse_proposer_spec
from macfleet.engine.proposers.base import Draft, Proposer, ProposerFailed
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.text import (MAX_PROMPT_TOKENS, Drafting, PromptError, TextDelta,
                                  TextStream, encode_prompt, generate_from_ids, make_group,
                                  no_drafts, plan_drafting)
from macfleet.engine.tree_loop import tree_budget
from macfleet.engine.verifier import Verifier
from macfleet.serve.engine import (DEFAULT_STALL_RATIO, ITERATION_HISTORY, BatchEngine,
                                   EngineRequest, Overloaded, SessionFailed)
from macfleet.stats import BlockFlows, FleetStats, FlowStats, KVFlow

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED = 8
DEFAULT_BATCH_SESSIONS = 16  # one forward over 16 sessions costs ~1.85x one here
DEFAULT_BATCH_QUEUE = 64
MAX_PROPOSERS = 8  # proposer endpoints one request may name
MAX_ENDPOINT_CHARS = 256
# refused before tokenizing: no tokenizer allocates for a prompt that cannot fit anyway
MAX_PROMPT_CHARS = 8 * MAX_PROMPT_TOKENS
# every queued or running request hears from us this often (an empty GenerateChunk when no token
# is ready: queued behind others, prefilling), so a client can call a verifier silent for a few
# seconds dead instead of waiting out a first-token deadline
HEARTBEAT_S = 1.0
KEEPALIVE_S = 1.0  # idle period after which a shard group's leader pings its followers


class VerifierLost(RuntimeError):
    """The verifier itself is gone (a shard rank died): no request can be served any more."""
DEFAULT_MAX_TOKENS_CAP = 4096

Reply = Callable[[object], int]


class FallbackProposer(Proposer):
    """Remote proposers in order of preference; the first that fails is dropped for the next."""

    def __init__(self, proposers: Sequence[RemoteProposer]) -> None:
        self._all = list(proposers)
        self._live = list(proposers)
        self.failures: list[str] = []
        self.name = self._live[0].spec if self._live else "none"

    @property
    def current(self) -> RemoteProposer | None:
        return self._live[0] if self._live else None

    @property
    def wants_features(self) -> bool:
        return any(p.wants_features for p in self._all)

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

    def propose(self, context, k: int, with_guess: bool = False) -> Draft:
        while self._live:
            p = self._live[0]
            try:
                return p.propose(context, k)
            except ProposerFailed as e:
                self._drop(e)
        raise ProposerFailed("no proposer left; continuing with plain decoding")

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        if self._live:  # the drafter on the other Mac learns from what became of its draft
            self._live[0].observe(drafted, accepted, verify_ms, verified)

    def begin(self, context, k: int) -> None:
        """Send the request to the first live proposer (dropping those that cannot take it)."""
        self._begun = (list(context), k)
        while self._live:
            try:
                self._live[0].begin(context, k)
                return
            except ProposerFailed as e:
                self._drop(e)
        raise ProposerFailed("no proposer left; continuing with plain decoding")

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
        """Per-block flows over every remote block, whichever proposer drafted it."""
        totals = FlowTotals()
        for p in self._all:
            totals += p.flows
        return totals.summary(f3_probe=any(p.f3_probe_width for p in self._all))


def draft_tokens_of(msg: GenerateRequest) -> DraftTokens:
    """The engine's draft length named by a request (its wire form is an int)."""
    return AUTO if msg.draft_tokens == AUTO_DRAFT_TOKENS else msg.draft_tokens


def check_request(msg: GenerateRequest, policy: SpecPolicy) -> None:
    """What a GenerateRequest may name, checked before it is queued (ProtocolError)."""
    if not isinstance(msg.prompt, str) or len(msg.prompt) > MAX_PROMPT_CHARS:
        raise ProtocolError(BAD_REQUEST, f"prompt longer than {MAX_PROMPT_CHARS} characters "
                                         f"(the limit is {MAX_PROMPT_TOKENS} tokens)")
    check_id(msg.request_id, "request_id")
    if len(msg.prefix_ids) > msg.max_tokens:
        raise ProtocolError(BAD_REQUEST, "prefix_ids are counted in max_tokens: at most "
                                         f"{msg.max_tokens} of them")
    if not isinstance(msg.proposer_spec, str) or len(msg.proposer_spec) > MAX_SPEC_CHARS:
        raise ProtocolError(BAD_REQUEST, f"proposer_spec: at most {MAX_SPEC_CHARS} characters")
    eps = msg.proposers
    if len(eps) > MAX_PROPOSERS:
        raise ProtocolError(BAD_REQUEST, f"at most {MAX_PROPOSERS} proposer endpoints")
    if any(not isinstance(e, str) or not e.startswith("tcp://") or len(e) > MAX_ENDPOINT_CHARS
           for e in eps):
        raise ProtocolError(BAD_REQUEST, "proposer endpoints must be tcp://HOST:PORT strings")
    if not eps:  # built here: the one spec check, with this agent's policy
        check_spec(msg.proposer_spec or "none", policy)
        return
    # drafted elsewhere: each proposer agent checks the names against its own heads directory
    for part in (msg.proposer_spec or "").split("+")[:MAX_PROPOSERS + 1]:
        try:
            parse_proposer_spec(part)
        except ProposerSpecError as e:
            raise ProtocolError(BAD_REQUEST, str(e)) from None


@dataclass(frozen=True)
class VerifierLimits:
    max_queued: int = DEFAULT_MAX_QUEUED
    max_tokens: int = DEFAULT_MAX_TOKENS_CAP
    batch_sessions: int = DEFAULT_BATCH_SESSIONS  # sessions in one batched forward (0: off)
    batch_queue: int = DEFAULT_BATCH_QUEUE  # requests waiting for a batch slot
    # prefill chunks sized so a batch iteration costs at most this many decode-only ones
    stall_ratio: float = DEFAULT_STALL_RATIO
    # finished sessions' KV kept for later prompts that start the same (serve/prompt_cache.py)
    prompt_cache_mb: int = 512


class VerifierService:
    def __init__(self, lm: LoadedModel, *, node_id: str, key: bytes | None,
                 publish: Callable[[object], None] | None = None,
                 limits: VerifierLimits = VerifierLimits(), f3_probe: bool = False,
                 verifier=None, on_fatal: Callable[[str], None] | None = None,
                 f3_codec: str = "float16", policy: SpecPolicy | None = None,
                 prefill_endpoints: Callable[[], list[str]] | None = None,
                 disagg=None, peers: Callable[[Sequence[str]], None] | None = None) -> None:
        """verifier: a Verifier-like object (a ShardedVerifier on a shard group's rank 0);
        on_fatal: called when the verifier itself is lost (a shard died): the agent stops;
        prefill_endpoints: live prefill agents for this model (flow KV, agents/remote_prefill),
        with `disagg` (a DisaggPolicy) saying when to use them; peers: raises
        ProtocolError(forbidden) for proposer endpoints this agent may not connect to
        (bridge.peers; None: every endpoint is refused)."""
        self.lm = lm
        self._peers = peers or PeerAllowlist(key).check
        self.node_id = node_id
        self.key = key
        self.limits = limits
        self.policy = policy or SpecPolicy(own_model=lm.spec)
        self.models = DraftModels()
        # F3 probe width: what an EAGLE-style drafter reads, the last layer's hidden state
        self.f3_probe_width = lm.hidden_size if f3_probe else 0
        self._publish = publish or (lambda m: None)
        self._jobs: queue.Queue = queue.Queue(maxsize=limits.max_queued)
        self._verifier = verifier if verifier is not None else Verifier(lm.model)
        self._on_fatal = on_fatal
        self._feature_tap = None
        self.f3_codec = f3_codec
        self._keepalive = self._verifier.keepalive if self._verifier.needs_keepalive else None
        self._solo = 0  # one-session generations running (0 or 1)
        self.completed = 0
        self._pending: dict[int, tuple[str, Reply]] = {}  # queued or running -> heartbeats
        self._pending_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verifier-compute", daemon=True)
        self._thread.start()
        self._beat = threading.Thread(target=self._heartbeats, name="verifier-heartbeat",
                                      daemon=True)
        self._beat.start()
        self._batch = None  # the continuous batch (a plain verifier only)
        self._compute = contextlib.nullcontext()
        if limits.batch_sessions > 0 and verifier is None:
            self._start_batch()
        self._stage = None
        if prefill_endpoints is not None and verifier is None:
            from agents.remote_prefill import DisaggPolicy, PrefillStage

            self._stage = PrefillStage(lm, key=key, layout=model_layout(lm.model),
                                       endpoints=prefill_endpoints, submit=self._submit,
                                       policy=disagg or DisaggPolicy())

    def _start_batch(self) -> None:
        lock = threading.Lock()
        try:
            self._batch = BatchEngine(self.lm, proposer="none",
                                      max_active=self.limits.batch_sessions,
                                      max_queue=self.limits.batch_queue,
                                      stall_ratio=self.limits.stall_ratio, compute_lock=lock,
                                      prompt_cache_bytes=self.limits.prompt_cache_mb << 20)
        except ValueError as e:  # a model the flat forward cannot run: one session at a time
            log.warning("no continuous batching for %s: %s", self.lm.spec, e)
            return
        self._compute = lock
        self._batch.start()

    @property
    def active(self) -> int:
        """Generations running now: the one-session path's and the batch's."""
        return self._solo + (self._batch.load()[0] if self._batch is not None else 0)

    @property
    def batching(self) -> bool:
        return self._batch is not None

    def batch_view(self):
        """The continuous batch (iterations, sessions) as `serve` and the dashboard show it."""
        return self._batch.batch_view(self.lm.spec) if self._batch is not None else None

    def batch_status(self, recent: int) -> BatchStatus:
        """The batch for a BatchStatusRequest (`recent` clamped to what is kept)."""
        if self._batch is None:
            return BatchStatus(batching=False, active=self._solo, waiting=self._jobs.qsize(),
                               iterations=0, recent=(), sessions=())
        v = self._batch.batch_view(self.lm.spec, max(0, min(int(recent), ITERATION_HISTORY)))
        return BatchStatus(batching=True, active=v.active, waiting=v.waiting,
                           iterations=v.iterations, recent=v.recent, sessions=v.sessions)

    def _heartbeats(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            with self._pending_lock:
                pending = list(self._pending.values())
            for rid, reply in pending:
                reply(GenerateChunk(rid, [], ""))

    def fail_pending(self, why: str) -> int:
        """Answer every queued or running request with `unavailable` (the verifier is lost and
        its compute thread may be stuck in a collective that never returns); returns how many."""
        with self._pending_lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for rid, reply in pending:
            reply(ErrorReply(UNAVAILABLE, f"the verifier is lost: {why}"))
        return len(pending)

    def close(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        if self._batch is not None:
            self._batch.stop(timeout)
        if self._stage is not None:
            self._stage.close()
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def handle(self, msg, reply: Reply) -> bool:
        if not isinstance(msg, GenerateRequest):
            return False
        if not 0 <= msg.max_tokens <= self.limits.max_tokens:
            raise ProtocolError(BAD_REQUEST, f"max_tokens must be 0..{self.limits.max_tokens}")
        if msg.draft_tokens != AUTO_DRAFT_TOKENS and not 0 <= msg.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ProtocolError(BAD_REQUEST, f"draft_tokens must be {AUTO_DRAFT_TOKENS} (auto) or "
                                             f"0..{MAX_DRAFT_TOKENS}")
        try:
            SamplingParams(msg.temperature, msg.top_p, msg.seed)
        except ValueError as e:
            raise ProtocolError(BAD_REQUEST, str(e)) from None
        check_request(msg, self.policy)
        self._peers(msg.proposers)  # before any connection: fleet members only (no SSRF)
        if self._batch is not None and not (self._stage is not None and self._stage.wants(msg)):
            self._submit_batched(msg, reply)
            return True
        with self._pending_lock:
            try:
                if self._stage is not None and self._stage.wants(msg):
                    self._stage.put(msg, reply)  # a long prompt may prefill elsewhere first
                else:
                    self._jobs.put_nowait((msg, reply, None))
            except queue.Full:
                raise ProtocolError(BUSY, f"{self.limits.max_queued} generations queued") from None
            self._pending[id(reply)] = (msg.request_id, reply)
        return True

    def _submit_batched(self, msg: GenerateRequest, reply: Reply, staged=None) -> None:
        """Into the continuous batch: its drafter (a chain on remote proposers in order of
        preference, a tree drafted on all of them at once, or this agent's own) drafts per
        session, cross-round, while the batch verifies every session's block or tree in one
        forward; events become wire messages here."""
        params = SamplingParams(msg.temperature, msg.top_p, msg.seed)
        if any(not 0 <= t < self.lm.vocab_size for t in msg.prefix_ids):
            raise ProtocolError(BAD_REQUEST, "prefix ids outside the vocabulary")
        try:
            ids = staged.ids if staged is not None else (
                encode_prompt(self.lm.tokenizer, msg.prompt, msg.chat) + list(msg.prefix_ids))
            proposer = self._drafting(msg, batched=True)
        except (PromptError, ProposerSpecError, ValueError) as e:
            raise ProtocolError(BAD_REQUEST, str(e)) from None
        req = EngineRequest(prompt=tuple(ids), params=params,
                            max_tokens=max(0, msg.max_tokens - len(msg.prefix_ids)),
                            eos_ids=self.lm.eos_ids, draft_tokens=draft_tokens_of(msg),
                            report_blocks=True)
        rid, stream, parts = msg.request_id, TextStream(self.lm.tokenizer), []
        remote = (proposer if isinstance(proposer, (FallbackProposer, RemoteProposerGroup))
                  else None)
        kv = staged.kv if staged is not None else None
        kv_once = ({"kv_bytes": staged.flow.kv_bytes, "kv_ms": staged.flow.kv_ms}
                   if kv is not None else {})

        def emit(ev) -> None:
            if isinstance(ev, TokensCommitted):
                text = stream.add(ev.tokens)
                parts.append(text)
                reply(GenerateChunk(rid, list(ev.tokens), text))
            elif isinstance(ev, BlockDone):
                last = (self._last_flows(remote) if remote is not None and ev.k > 0
                        else None) or BlockFlows()
                self._publish_block(rid, ev, last, probe=bool(self.f3_probe_width),
                                    **(kv_once if ev.block == 1 else {}))
            elif isinstance(ev, Finished):
                tail = stream.finish()
                if tail:
                    parts.append(tail)
                    reply(GenerateChunk(rid, [], tail))
                flows, failures = ((remote.flow_stats(), remote.failures) if remote is not None
                                   else (FlowStats(), []))
                fleet = FleetStats(verifier=self.node_id, flows=flows,
                                   proposer_failures=len(failures),
                                   kv=self._batched_kv_flow(staged, len(ids), ev.stats.prefill_ms))
                self.completed += 1
                reply(GenerateDone(rid, "".join(parts), list(ev.token_ids),
                                   replace(ev.stats, fleet=fleet)))
            elif isinstance(ev, SessionFailed):
                reply(ErrorReply(INTERNAL, ev.message))

        def on_close() -> None:
            with self._pending_lock:
                self._pending.pop(id(reply), None)

        with self._pending_lock:  # heartbeats while queued; the engine's on_close ends them
            self._pending[id(reply)] = (rid, reply)
        try:
            self._batch.submit(req, emit, on_close, proposer=proposer, kv=kv)
        except (Overloaded, ValueError) as e:
            on_close()
            if proposer is not None:
                proposer.close()
            code = BUSY if isinstance(e, Overloaded) else BAD_REQUEST
            raise ProtocolError(code, str(e)) from None

    def _publish_block(self, rid: str, ev: BlockDone, last: BlockFlows, *, probe: bool,
                       **extra) -> None:
        """One verified block's metrics on the PUB socket (both paths: batched and alone);
        extra: the shard flow, and flow KV on a session's first block."""
        self._publish(BlockMetrics(
            node_id=self.node_id, session_id=rid, block=ev.block, k=ev.k,
            accepted=ev.accepted, block_ms=ev.block_ms, draft_ms=ev.draft_ms,
            verify_ms=ev.verify_ms, f1_bytes=last.f1_bytes, f1_ms=last.f1_ms,
            f2_bytes=last.f2_bytes, f2_ms=last.f2_ms, f3_bytes=last.f3_bytes, f3_ms=last.f3_ms,
            probe=probe, hidden_size=self.lm.hidden_size, **extra))

    def _batched_kv_flow(self, staged, tokens: int, prefill_ms: float) -> KVFlow:
        """Flow KV of a batched session: installed (its install time is the session's prefill
        time), or prefilled here after all (which teaches the stage's meter)."""
        if staged is None:
            return KVFlow()
        if staged.kv is not None:
            return replace(staged.flow, install_ms=prefill_ms)
        self._stage.meter.local(tokens - 1, prefill_ms)
        return staged.flow

    def _submit(self, msg: GenerateRequest, reply: Reply, staged) -> None:
        """The prefill stage hands a request on: into the batch when it can run there (its
        shipped KV installed in a batch row), else to the one-session queue (waits while full)."""
        if self._batch is not None:
            try:
                self._submit_batched(msg, reply, staged)
            except ProtocolError as e:
                with self._pending_lock:
                    self._pending.pop(id(reply), None)
                reply(ErrorReply(e.code, e.message))
            return
        self._jobs.put((msg, reply, staged))

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=KEEPALIVE_S if self._keepalive else None)
            except queue.Empty:
                if not self._idle_keepalive():
                    return
                continue
            if job is None:
                return
            msg, reply, staged = job
            self._solo += 1
            try:
                with self._compute:  # the batch waits while one session runs alone
                    self._generate(msg, reply, staged)
            except VerifierLost as e:
                reply(ErrorReply(UNAVAILABLE, f"the sharded verifier lost a rank: {e}"))
                self._fatal(str(e))
                return
            except (PromptError, ProposerSpecError, ValueError) as e:
                reply(ErrorReply(BAD_REQUEST, str(e)))
            except Exception as e:  # the daemon never dies of a request; the client gets why
                log.exception("generation failed")
                reply(ErrorReply(INTERNAL, f"{type(e).__name__}: {e}"))
            finally:
                self._solo -= 1
                with self._pending_lock:
                    self._pending.pop(id(reply), None)

    def _idle_keepalive(self) -> bool:
        """Keep a shard group's watchdogs fed while idle; False once the group is lost."""
        try:
            self._keepalive()
            return True
        except VerifierLost as e:
            self._fatal(str(e))
            return False

    def _fatal(self, why: str) -> None:
        log.error("verifier lost: %s", why)
        if self._on_fatal is not None:
            self._on_fatal(why)

    def _drafting(self, msg: GenerateRequest, batched: bool = False) -> Drafting:
        """What drafts for this request: remote proposer agents when it names endpoints (a
        chain falls back from one to the next, a tree drafts on all at once), else this agent's
        own drafters; tree or chain is decided as in-process (engine/text.py plan_drafting).
        batched: for a session of the continuous batch (hidden-state drafters are fed its rows
        by the batch engine instead of tapping this verifier's forwards)."""
        spec = msg.proposer_spec or "none"
        if msg.proposers:
            return plan_drafting(spec, chain=lambda s: self._fallback(msg, batched),
                                 tree=lambda specs: self._tree_group(msg, specs, batched))

        def make(s: str) -> Proposer | None:
            return make_checked_proposer(s, self.lm, self.policy, self.models)

        return plan_drafting(spec, chain=make, tree=lambda specs: make_group(
            [make(s) or no_drafts(s) for s in specs], draft_tokens_of(msg)))

    def _fallback(self, msg: GenerateRequest, batched: bool = False) -> FallbackProposer:
        """One chain drafter on the named endpoints, in order of preference."""
        feats = self._features(msg.proposer_spec, batched)
        return FallbackProposer([
            RemoteProposer(ep, key=self.key, proposer=msg.proposer_spec, model=self.lm.spec,
                           cross_round=msg.cross_round,
                           f3_probe_width=0 if feats else self.f3_probe_width,
                           features=feats, f3_codec=self.f3_codec)
            for ep in msg.proposers])

    def _features(self, spec: str, batched: bool = False):
        """Real F3 for a remote hidden-state drafter: tap this verifier's own forwards (one
        session at a time), or take the rows the batch engine feeds this session."""
        if not spec.startswith("eagle"):
            return None
        from macfleet.engine.proposers.eagle.chain import VerifierFeatures

        if batched:
            return VerifierFeatures(self.lm.model, tap=False)
        if not hasattr(self._verifier, "cache"):
            return None
        self._feature_tap = VerifierFeatures(self.lm.model)
        return self._feature_tap

    @staticmethod
    def _last_flows(proposer) -> BlockFlows | None:
        """Flow figures of the block just verified (the slowest proposer's, for a tree)."""
        if isinstance(proposer, FallbackProposer):
            return proposer.current.flows.last if proposer.current else None
        if isinstance(proposer, RemoteProposerGroup):
            lasts = [p.flows.last for p, live in zip(proposer.proposers, proposer.live)
                     if live and p.flows.last]
            if not lasts:
                return None
            worst = max(lasts, key=lambda f: f.wire_ms)
            return replace(worst, f1_bytes=sum(f.f1_bytes for f in lasts),
                           f2_bytes=sum(f.f2_bytes for f in lasts))
        return None

    def _tree_group(self, msg: GenerateRequest, specs: list[str],
                    batched: bool = False) -> RemoteProposerGroup:
        """`a+b+c` with N endpoints: proposer i drafts spec i (the last spec repeats)."""
        spec_of = [specs[min(i, len(specs) - 1)] for i in range(len(msg.proposers))]
        feats = next((self._features(s, batched) for s in spec_of if s.startswith("eagle")),
                     None)
        remotes = [RemoteProposer(ep, key=self.key, proposer=spec, model=self.lm.spec,
                                  cross_round=msg.cross_round,
                                  f3_probe_width=self.f3_probe_width,
                                  features=feats if spec.startswith("eagle") else None,
                                  f3_codec=self.f3_codec)
                   for ep, spec in zip(msg.proposers, spec_of)]
        return RemoteProposerGroup(remotes, draft_tokens=draft_tokens_of(msg),
                                   node_budget=tree_budget(remotes))

    def _generate(self, msg: GenerateRequest, reply: Reply, staged=None) -> None:
        params = SamplingParams(msg.temperature, msg.top_p, msg.seed)
        if any(not 0 <= t < self.lm.vocab_size for t in msg.prefix_ids):
            raise ValueError("prefix ids outside the vocabulary")
        ids = staged.ids if staged is not None else (
            encode_prompt(self.lm.tokenizer, msg.prompt, msg.chat) + list(msg.prefix_ids))
        verifier, kv_once = self._verifier, {}
        if staged is not None and staged.kv is not None:  # flow KV: installed, not computed
            verifier = PrefilledVerifier(self._verifier, ids[:-1], self._stage.layout, staged.kv)
            kv_once = {"kv_bytes": staged.flow.kv_bytes, "kv_ms": staged.flow.kv_ms}
        proposer = self._drafting(msg)
        max_new = max(0, msg.max_tokens - len(msg.prefix_ids))
        parts: list[str] = []
        block_ms = wire_ms = 0.0
        stats = None
        remote = proposer if isinstance(proposer, FallbackProposer) else None
        shard_now = self._verifier.shard_stats  # a sharded verifier's shard flow, else None
        shard_prev = None
        events = generate_from_ids(self.lm, verifier, proposer, ids,
                                   draft_tokens=draft_tokens_of(msg), max_tokens=max_new,
                                   params=params)
        try:
            for ev in events:
                if isinstance(ev, TextDelta):  # the last one: the detokenizer's flush, no ids
                    parts.append(ev.text)
                    reply(GenerateChunk(msg.request_id, list(ev.tokens), ev.text))
                elif isinstance(ev, BlockDone):
                    last = (self._last_flows(proposer) if ev.k > 0 else None) or BlockFlows()
                    wire_ms += last.wire_ms
                    block_ms += ev.block_ms
                    shard = shard_now()
                    sh = block_delta(shard_prev, shard)
                    shard_prev = shard
                    # measured where a collective was timed, else priced (and marked so)
                    self._publish_block(
                        msg.request_id, ev, last,
                        probe=bool(self.f3_probe_width) and self._feature_tap is None,
                        shard_bytes=sh.bytes, shard_ms=sh.ms or sh.priced_ms,
                        shard_priced=not sh.ms and sh.priced_ms > 0, rank_load=sh.rank_load,
                        **kv_once)
                    kv_once = {}
                elif isinstance(ev, Finished):
                    stats = ev.stats
                    token_ids = list(ev.token_ids)
        finally:
            if proposer is not None:
                proposer.close()
            if self._feature_tap is not None:
                self._feature_tap.close()
                self._feature_tap = None
        flows, failures = FlowStats(), []
        if remote is not None:
            flows, failures = remote.flow_stats(), remote.failures
        elif isinstance(proposer, RemoteProposerGroup):
            flows, failures = proposer.flow_stats(), proposer.failures
        kv = self._kv_flow(staged, verifier, len(ids), stats.prefill_ms)
        fleet = FleetStats(verifier=self.node_id, flows=flows, proposer_failures=len(failures),
                           wire_ms=wire_ms, kv=kv,
                           multihost_overhead=wire_ms / block_ms if block_ms else 0.0,
                           shard=shard_now())
        self.completed += 1
        reply(GenerateDone(msg.request_id, "".join(parts), token_ids,
                           replace(stats, fleet=fleet)))

    def _kv_flow(self, staged, verifier, tokens: int, prefill_ms: float) -> KVFlow:
        """Flow KV of a finished generation; a local prefill also teaches the stage's meter."""
        if staged is None:
            return KVFlow()
        if isinstance(verifier, PrefilledVerifier) and verifier.installed:
            return replace(staged.flow, install_ms=verifier.install_ms)
        self._stage.meter.local(tokens - 1, prefill_ms)
        return staged.flow
