"""The verifier role: checks each GenerateRequest, queues it and heartbeats it until it ends.

A request runs in the continuous batch, or alone on this agent's compute thread (a sharded
verifier, a model the batch cannot run), through `VerifierGenerations`
(agents/verifier_generate.py), drafted as agents/verifier_drafting.py decides: by the proposer
agents it names (ZeroMQ endpoints, in order of preference) or by this agent's own drafters.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents.remote_proposer import DEFAULT_DRAFT_TIMEOUT_S
from agents.specs import (MAX_SPEC_CHARS, DraftModels, SpecPolicy, check_id, check_sampling,
                          check_spec, check_tokens)
from agents.verifier_drafting import RequestDrafting
from agents.verifier_generate import Pending, VerifierGenerations
from bridge.errors import BAD_REQUEST, BUSY, INTERNAL, UNAVAILABLE, ProtocolError
from bridge.messages import (AUTO_DRAFT_TOKENS, MAX_PREDICTION_IDS, MAX_TOP_LOGPROBS,
                             BatchStatus, ErrorReply, GenerateChunk, GenerateRequest)
from bridge.peers import PeerAllowlist
from bridge.transport import Reply
from macfleet.engine.constraint import Grammar, grammar_error
from macfleet.engine.controller import AUTO, MAX_DRAFT_TOKENS
from macfleet.engine.kvship import model_layout
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import ProposerSpecError, parse_proposer_spec
from macfleet.engine.text import MAX_PROMPT_TOKENS, PromptError
from macfleet.engine.verifier import Verifier
from macfleet.serve.engine import DEFAULT_STALL_RATIO, ITERATION_HISTORY, BatchEngine

log = logging.getLogger(__name__)

MAX_PROPOSERS = 8  # proposer endpoints one request may name
MAX_ENDPOINT_CHARS = 256
# refused before tokenizing: no tokenizer allocates for a prompt that cannot fit anyway
MAX_PROMPT_CHARS = 8 * MAX_PROMPT_TOKENS
# every queued or running request hears from us this often (an empty GenerateChunk while no
# token is ready), so a client can call a verifier silent for a few seconds dead
HEARTBEAT_S = 1.0
KEEPALIVE_S = 1.0  # idle period after which a shard group's leader pings its followers


class VerifierLost(RuntimeError):
    """The verifier itself is gone (a shard rank died): no request can be served any more."""


def check_request(msg: GenerateRequest, policy: SpecPolicy, max_tokens: int, vocab: int) -> None:
    """What a GenerateRequest may ask, checked before it is queued (ProtocolError)."""
    if not 0 <= msg.max_tokens <= max_tokens:
        raise ProtocolError(BAD_REQUEST, f"max_tokens must be 0..{max_tokens}")
    if msg.draft_tokens != AUTO_DRAFT_TOKENS and not 0 <= msg.draft_tokens <= MAX_DRAFT_TOKENS:
        raise ProtocolError(BAD_REQUEST, f"draft_tokens must be {AUTO_DRAFT_TOKENS} (auto) or "
                                         f"0..{MAX_DRAFT_TOKENS}")
    check_sampling(msg.temperature, msg.top_p, msg.seed)
    check_tokens(msg.prefix_ids, vocab, "prefix")
    if msg.top_logprobs is not None and not 0 <= msg.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ProtocolError(BAD_REQUEST, f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}")
    if msg.grammar_kind:
        # either path runs the serving engine, which follows a grammar alone or batched
        err = grammar_error(Grammar(msg.grammar_kind, msg.grammar_source))
        if err is not None:
            raise ProtocolError(BAD_REQUEST, f"response_format: {err.strip()[:500]}")
    if len(msg.prediction_ids) > MAX_PREDICTION_IDS:
        raise ProtocolError(BAD_REQUEST, f"prediction: over {MAX_PREDICTION_IDS} tokens")
    if not isinstance(msg.prompt, str) or len(msg.prompt) > MAX_PROMPT_CHARS:
        raise ProtocolError(BAD_REQUEST, f"prompt longer than {MAX_PROMPT_CHARS} characters "
                                         f"(the limit is {MAX_PROMPT_TOKENS} tokens)")
    check_id(msg.request_id, "request_id")
    if msg.cache_partition:
        check_id(msg.cache_partition, "cache_partition")
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
    if msg.proposer_spec == AUTO:  # the chooser over this agent's own shipped drafters
        if eps:
            raise ProtocolError(BAD_REQUEST, f"'{AUTO}' is chosen on the verifier among its own "
                                             "drafters: name a drafter for proposer agents")
        return
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
    max_queued: int = 8
    max_tokens: int = 4096
    batch_sessions: int = 16  # sessions in one batched forward (0: off)
    batch_queue: int = 64  # requests waiting for a batch slot
    # prefill chunks sized so a batch iteration costs at most this many decode-only ones
    stall_ratio: float = DEFAULT_STALL_RATIO
    # finished sessions' KV kept for later prompts that start the same (serve/prompt_cache.py)
    prompt_cache_mb: int = 512
    # a remote proposer's draft not back within this fails it (the block decodes plainly)
    draft_timeout_s: float = DEFAULT_DRAFT_TIMEOUT_S


class VerifierService:
    """The verifier role's plumbing: checks a request, queues it into the continuous batch or
    onto the one-session compute thread, heartbeats it, keeps an idle shard group alive."""

    def __init__(self, lm: LoadedModel, *, node_id: str, key: bytes | None,
                 publish: Callable[[object], None] | None = None,
                 limits: VerifierLimits = VerifierLimits(), f3_probe: bool = False,
                 verifier=None, on_fatal: Callable[[str], None] | None = None,
                 f3_codec: str = "float16", policy: SpecPolicy | None = None,
                 prefill_endpoints: Callable[[], list[str]] | None = None,
                 disagg=None, peers: Callable[[Sequence[str]], None] | None = None) -> None:
        """verifier: a ShardedVerifier on a shard group's rank 0; on_fatal: called when it is
        lost; prefill_endpoints: live prefill agents (flow KV), used as `disagg` says; peers:
        refuses proposer endpoints this agent may not connect to (None: all of them)."""
        self.lm = lm
        self._peers = peers or PeerAllowlist(key).check
        self.limits = limits
        self.policy = policy or SpecPolicy(own_model=lm.spec)
        self._jobs: queue.Queue = queue.Queue(maxsize=limits.max_queued)
        self._verifier = verifier if verifier is not None else Verifier(lm.model)
        self._on_fatal = on_fatal
        # the F3 probe's width: what an EAGLE-style drafter reads, the last layer's hidden state
        drafts = RequestDrafting(lm, key=key, policy=self.policy, models=DraftModels(),
                                 verifier=self._verifier,
                                 f3_probe_width=lm.hidden_size if f3_probe else 0,
                                 f3_codec=f3_codec, draft_timeout_s=limits.draft_timeout_s)
        self._keepalive = self._verifier.keepalive if self._verifier.needs_keepalive else None
        self._solo = 0  # one-session generations running (0 or 1)
        self._pending = Pending()  # queued or running -> heartbeats
        self.generations = VerifierGenerations(
            lm, node_id=node_id, verifier=self._verifier, drafts=drafts,
            pending=self._pending, publish=publish or (lambda m: None))
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verifier-compute", daemon=True)
        self._thread.start()
        self._beat = threading.Thread(target=self._heartbeats, name="verifier-heartbeat",
                                      daemon=True)
        self._beat.start()
        self._batch = None  # the continuous batch (a plain verifier only)
        if limits.batch_sessions > 0 and verifier is None:
            self._start_batch()
        self._stage = None
        if prefill_endpoints is not None and verifier is None:
            from agents.remote_prefill import DisaggPolicy, PrefillStage

            self._stage = PrefillStage(lm, key=key, layout=model_layout(lm.model),
                                       endpoints=prefill_endpoints, submit=self._submit,
                                       policy=disagg or DisaggPolicy())
        self.generations.stage = self._stage

    def _start_batch(self) -> None:
        try:
            self._batch = BatchEngine(self.lm, proposer="none",
                                      max_active=self.limits.batch_sessions,
                                      max_queue=self.limits.batch_queue,
                                      stall_ratio=self.limits.stall_ratio,
                                      prompt_cache_bytes=self.limits.prompt_cache_mb << 20)
        except ValueError as e:  # a model the flat forward cannot run: one session at a time
            log.warning("no continuous batching for %s: %s", self.lm.spec, e)
            return
        self._batch.start()
        self.generations.batch = self._batch

    @property
    def active(self) -> int:
        """Generations running now: the one-session path's and the batch's."""
        return self._solo + (self._batch.load()[0] if self._batch is not None else 0)

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
            for rid, reply in self._pending.held():
                reply(GenerateChunk(rid, [], ""))

    def fail_pending(self, why: str) -> int:
        """Answer every queued or running request with `unavailable` (the verifier is lost and
        its compute thread may be stuck in a collective that never returns); returns how many."""
        pending = self._pending.take_all()
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
        check_request(msg, self.policy, self.limits.max_tokens, self.lm.vocab_size)
        self._peers(msg.proposers)  # before any connection: fleet members only (no SSRF)
        # decided once: with a batch, the one-session queue never runs a request beside it
        staged = self._stage is not None and self._stage.wants(msg)
        if self._batch is not None and not staged:
            self.generations.submit_batched(msg, reply)
            return True

        def queue_it() -> None:
            if staged:
                self._stage.put(msg, reply)  # a long prompt may prefill elsewhere first
            else:
                self._jobs.put_nowait((msg, reply, None))

        try:
            self._pending.add(msg.request_id, reply, before=queue_it)
        except queue.Full:
            raise ProtocolError(BUSY, f"{self.limits.max_queued} generations queued") from None
        return True

    def _submit(self, msg: GenerateRequest, reply: Reply, staged) -> None:
        """The prefill stage hands a request on: into the batch when it can run there (its
        shipped KV installed in a batch row), else to the one-session queue (waits while full)."""
        if self._batch is not None:
            try:
                self.generations.submit_batched(msg, reply, staged)
            except ProtocolError as e:
                self._pending.drop(reply)
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
                self.generations.generate(msg, reply, staged)
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
                self._pending.drop(reply)

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

