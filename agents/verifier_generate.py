"""A verifier agent's generations: a request into the continuous batch, or one session alone.

Both turn the engine's events into wire messages (GenerateChunk, GenerateDone, BlockMetrics on
the PUB socket); one `Crossing` a generation adds what crossing hosts cost (drafter flows,
multi-host overhead, flow KV, shard flow). `VerifierService` owns the queue, batch and compute
thread these run on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from agents.remote_tree import RemoteProposerGroup
from agents.shard_traffic import block_delta
from agents.verifier_drafting import (FallbackProposer, RequestDrafting, draft_tokens_of,
                                      last_flows, probed)
from bridge.errors import BAD_REQUEST, BUSY, INTERNAL, ProtocolError
from bridge.messages import BlockMetrics, ErrorReply, GenerateChunk, GenerateDone, GenerateRequest
from bridge.transport import Reply
from macfleet.engine.constraint import Grammar
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.models import LoadedModel
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.proposers import ProposerSpecError
from macfleet.engine.text import Drafting, PromptError, TextStream, encode_prompt
from macfleet.engine.tree_verify import supports_tree_attention
from macfleet.serve.engine import EngineRequest, Overloaded, SessionFailed
from macfleet.serve.one import one_engine, run_one
from macfleet.serve.logprobs import LogprobsCommitted
from macfleet.serve.prompt_cache import PromptReused
from macfleet.stats import (BlockFlows, FleetStats, FlowStats, KVFlow, ShardStats,
                            multihost_overhead)


class Pending:
    """The requests queued or running, which the service heartbeats (and fails when the
    verifier is lost) until each one ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[int, tuple[str, Reply]] = {}

    def add(self, rid: str, reply: Reply, before: Callable[[], None] | None = None) -> None:
        """Hold `reply`; `before` (queueing it) runs under the same lock, so the request cannot
        end before it is held. An exception from `before` holds nothing."""
        with self._lock:
            if before is not None:
                before()
            self._by[id(reply)] = (rid, reply)

    def drop(self, reply: Reply) -> None:
        with self._lock:
            self._by.pop(id(reply), None)

    def held(self) -> list[tuple[str, Reply]]:
        with self._lock:
            return list(self._by.values())

    def take_all(self) -> list[tuple[str, Reply]]:
        with self._lock:
            out = list(self._by.values())
            self._by.clear()
        return out


class Crossing:
    """What one generation pays for crossing hosts: each block's metrics published (`block`),
    and at its end its `FleetStats` (`fleet`)."""

    def __init__(self, gens: VerifierGenerations, rid: str, drafter, staged) -> None:
        self.gens, self.rid, self.drafter, self.staged = gens, rid, drafter, staged
        shipped = staged is not None and staged.kv is not None
        self.kv_once = ({"kv_bytes": staged.flow.kv_bytes, "kv_ms": staged.flow.kv_ms}
                        if shipped else {})
        self.wire_ms = self.block_ms = 0.0  # over every block, as the dashboard sums them

    def block(self, ev: BlockDone, **extra) -> None:
        """One verified block's metrics on the PUB socket; extra: a sharded verifier's shard
        flow."""
        last = (last_flows(self.drafter) if ev.k > 0 else None) or BlockFlows()
        self.gens.publish(BlockMetrics(
            node_id=self.gens.node_id, session_id=self.rid, block=ev.block, k=ev.k,
            accepted=ev.accepted, block_ms=ev.block_ms, draft_ms=ev.draft_ms,
            verify_ms=ev.verify_ms, f1_bytes=last.f1_bytes, f1_ms=last.f1_ms,
            f2_bytes=last.f2_bytes, f2_ms=last.f2_ms, f3_bytes=last.f3_bytes, f3_ms=last.f3_ms,
            probe=probed(self.drafter), hidden_size=self.gens.lm.hidden_size,
            ahead_lead=last.ahead_lead,
            ahead_waste=last.ahead_waste if last.ahead_lead or last.ahead_waste else -1.0,
            drafter=ev.drafter, why=ev.why, **extra, **self.kv_once))
        self.kv_once = {}
        self.wire_ms += last.wire_ms
        self.block_ms += ev.block_ms

    def fleet(self, tokens: int, prefill_ms: float, install_ms: float | None,
              shard: ShardStats | None = None) -> FleetStats:
        """The remote drafters' flows and failures, the wire time and its share, and flow KV:
        installed (`install_ms`), or (None) prefilled here after all, which teaches the meter."""
        flows, failures = FlowStats(), []
        if isinstance(self.drafter, (FallbackProposer, RemoteProposerGroup)):
            flows, failures = self.drafter.flow_stats(), self.drafter.failures
        kv = KVFlow() if self.staged is None else self.staged.flow
        if self.staged is not None and install_ms is not None:
            kv = replace(kv, install_ms=install_ms)
        elif self.staged is not None:
            self.gens.stage.meter.local(tokens - 1, prefill_ms)
        return FleetStats(verifier=self.gens.node_id, flows=flows,
                          proposer_failures=len(failures), wire_ms=self.wire_ms,
                          multihost_overhead=multihost_overhead(self.wire_ms, self.block_ms),
                          kv=kv, shard=shard)


class VerifierGenerations:
    """Runs the requests `VerifierService` accepted: `submit_batched` into the continuous batch,
    `generate` one session alone on the service's compute thread."""

    def __init__(self, lm: LoadedModel, *, node_id: str, verifier, drafts: RequestDrafting,
                 pending: Pending, publish: Callable[[object], None]) -> None:
        self.lm, self.node_id, self.verifier, self.drafts = lm, node_id, verifier, drafts
        self.pending, self.publish = pending, publish
        self.batch = None  # the continuous batch (a BatchEngine), when the service runs one
        self.stage = None  # the prefill stage (agents/remote_prefill.PrefillStage), if any

    def submit_batched(self, msg: GenerateRequest, reply: Reply, staged=None) -> None:
        """Into the continuous batch, which verifies every session's block or tree in one
        forward while each session's drafter drafts cross-round."""
        try:
            req, proposer, emit = self._session(msg, reply, staged, batched=True)
        except (PromptError, ProposerSpecError, ValueError) as e:
            raise ProtocolError(BAD_REQUEST, str(e)) from None

        def on_close() -> None:
            self.pending.drop(reply)

        self.pending.add(msg.request_id, reply)  # heartbeats while queued; on_close ends them
        try:
            self.batch.submit(req, emit, on_close, proposer=proposer,
                              shipped_kv=staged.kv if staged is not None else None)
        except (Overloaded, ValueError) as e:
            on_close()
            if proposer is not None:
                proposer.close()
            code = BUSY if isinstance(e, Overloaded) else BAD_REQUEST
            raise ProtocolError(code, str(e)) from None

    def generate(self, msg: GenerateRequest, reply: Reply, staged=None) -> None:
        """One session alone, on the caller's thread, through the serving engine (serve/one.py):
        a flat batch of one, or the verifier's own forward where the flat batch cannot run it (a
        sharded verifier). A failed session raises (serve/one.py GenerationFailed)."""
        # a verifier of its own forward (a sharded one; one that fails on purpose in tests)
        own = not (self.verifier.pipelines and supports_tree_attention(self.lm.model))
        engine = one_engine(self.lm, self.verifier if own else None)
        req, proposer, emit = self._session(msg, reply, staged, batched=not own, own=own)
        try:
            for ev in run_one(engine, req, proposer,
                              shipped_kv=staged.kv if staged is not None else None):
                emit(ev)
        finally:
            self.drafts.close_tap()

    def _session(self, msg: GenerateRequest, reply: Reply, staged, *, batched: bool,
                 own: bool = False) -> tuple[EngineRequest, Drafting, Callable[[object], None]]:
        """The engine request, its drafter, and what turns its events into wire messages; own:
        it runs on the verifier's own forward, whose shard flow each block reports."""
        # its prefix ids were checked at the door (VerifierService.handle)
        ids = staged.ids if staged is not None else (
            encode_prompt(self.lm.tokenizer, msg.prompt, msg.chat) + list(msg.prefix_ids))
        proposer = self.drafts.drafting(msg, batched=batched)
        req = EngineRequest(prompt=tuple(ids),
                            params=SamplingParams(msg.temperature, msg.top_p, msg.seed),
                            max_tokens=max(0, msg.max_tokens - len(msg.prefix_ids)),
                            eos_ids=self.lm.eos_ids, draft_tokens=draft_tokens_of(msg),
                            report_blocks=True, logprobs=msg.top_logprobs,
                            grammar=(Grammar(msg.grammar_kind, msg.grammar_source)
                                     if msg.grammar_kind else None),
                            committed=tuple(msg.prefix_ids), partition=msg.cache_partition,
                            prediction=tuple(msg.prediction_ids))
        rid, stream, parts = msg.request_id, TextStream(self.lm.tokenizer), []
        lps: tuple = ()  # LogprobsCommitted comes right before the TokensCommitted it scores
        cached = 0
        shipped = staged is not None and staged.kv is not None
        crossing = Crossing(self, rid, proposer, staged)
        shard_now = self.verifier.shard_stats if own else (lambda: None)
        shard_prev = None

        def emit(ev) -> None:
            nonlocal lps, cached, shard_prev
            if isinstance(ev, LogprobsCommitted):
                lps = ev.entries
            elif isinstance(ev, PromptReused):
                cached = ev.tokens
            elif isinstance(ev, TokensCommitted):
                text = stream.add(ev.tokens)
                parts.append(text)
                reply(GenerateChunk(rid, list(ev.tokens), text,
                                    tuple(e.logprob for e in lps), tuple(e.top for e in lps)))
                lps = ()
            elif isinstance(ev, BlockDone):
                shard = shard_now()
                if shard is None:
                    crossing.block(ev)
                else:
                    sh = block_delta(shard_prev, shard)
                    shard_prev = shard
                    # measured where a collective was timed, else priced (and marked so)
                    crossing.block(ev, shard_bytes=sh.bytes, shard_ms=sh.ms or sh.priced_ms,
                                   shard_priced=not sh.ms and sh.priced_ms > 0,
                                   rank_load=sh.rank_load)
            elif isinstance(ev, Finished):
                tail = stream.finish()
                if tail:
                    parts.append(tail)
                    reply(GenerateChunk(rid, [], tail))
                # an installed KV's install time is the session's prefill time
                fleet = crossing.fleet(len(ids), ev.stats.prefill_ms,
                                       ev.stats.prefill_ms if shipped else None,
                                       shard=shard_now())
                reply(GenerateDone(rid, "".join(parts), list(ev.token_ids),
                                   replace(ev.stats, fleet=fleet), cached))
            elif isinstance(ev, SessionFailed):
                reply(ErrorReply(INTERNAL, ev.message))

        return req, proposer, emit
