"""A verifier agent's generations: a request into the continuous batch, or one session alone.

Both turn the engine's events into wire messages (GenerateChunk, GenerateDone, BlockMetrics
on the PUB socket) and add what crossing hosts cost (`FleetStats`: the flows to the proposer
agents, the multi-host overhead by `macfleet.stats.multihost_overhead`, flow KV, a sharded
verifier's shard flow). `VerifierGenerations` is a part of `VerifierService`
(agents/verifier_service.py), which owns the queue, the batch and the compute thread these run
on; it reads the service's model (`lm`, `node_id`, `_verifier`), its batch and prefill stage
(`_batch`, `_stage`), its drafting (`_drafts`), its PUB callback (`_publish`) and the pending
requests it heartbeats (`_pending`, `_pending_lock`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from agents.remote_tree import RemoteProposerGroup
from agents.shard_traffic import block_delta
from agents.verifier_drafting import FallbackProposer, draft_tokens_of, last_flows
from bridge.errors import BAD_REQUEST, BUSY, INTERNAL, ProtocolError
from bridge.messages import BlockMetrics, ErrorReply, GenerateChunk, GenerateDone, GenerateRequest
from macfleet.engine.constraint import Grammar
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.kvship import PrefilledVerifier
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.proposers import ProposerSpecError
from macfleet.engine.text import (PromptError, TextDelta, TextStream, encode_prompt,
                                  generate_from_ids)
from macfleet.serve.engine import EngineRequest, Overloaded, SessionFailed
from macfleet.serve.logprobs import LogprobsCommitted
from macfleet.serve.prompt_cache import PromptReused
from macfleet.stats import BlockFlows, FleetStats, FlowStats, KVFlow, multihost_overhead


Reply = Callable[[object], int]  # sends one message back to the request's client


class VerifierGenerations:
    """The request handlers of `VerifierService`: see the module docstring."""

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
            proposer = self._drafts.drafting(msg, batched=True)
        except (PromptError, ProposerSpecError, ValueError) as e:
            raise ProtocolError(BAD_REQUEST, str(e)) from None
        req = EngineRequest(prompt=tuple(ids), params=params,
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
        remote = (proposer if isinstance(proposer, (FallbackProposer, RemoteProposerGroup))
                  else None)
        kv = staged.kv if staged is not None else None
        kv_once = ({"kv_bytes": staged.flow.kv_bytes, "kv_ms": staged.flow.kv_ms}
                   if kv is not None else {})
        wire_ms = block_ms = 0.0  # over every block, as the dashboard sums its BlockMetrics

        def emit(ev) -> None:
            nonlocal wire_ms, block_ms, lps, cached
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
                last = (last_flows(remote) if remote is not None and ev.k > 0
                        else None) or BlockFlows()
                wire_ms += last.wire_ms
                block_ms += ev.block_ms
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
                                   proposer_failures=len(failures), wire_ms=wire_ms,
                                   multihost_overhead=multihost_overhead(wire_ms, block_ms),
                                   kv=self._batched_kv_flow(staged, len(ids), ev.stats.prefill_ms))
                self.completed += 1
                reply(GenerateDone(rid, "".join(parts), list(ev.token_ids),
                                   replace(ev.stats, fleet=fleet), cached))
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
            probe=probe, hidden_size=self.lm.hidden_size, ahead_lead=last.ahead_lead,
            ahead_waste=last.ahead_waste if last.ahead_lead or last.ahead_waste else -1.0,
            **extra))

    def _batched_kv_flow(self, staged, tokens: int, prefill_ms: float) -> KVFlow:
        """Flow KV of a batched session: installed (its install time is the session's prefill
        time), or prefilled here after all (which teaches the stage's meter)."""
        if staged is None:
            return KVFlow()
        if staged.kv is not None:
            return replace(staged.flow, install_ms=prefill_ms)
        self._stage.meter.local(tokens - 1, prefill_ms)
        return staged.flow

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
        proposer = self._drafts.drafting(msg)
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
                    last = (last_flows(proposer) if ev.k > 0 else None) or BlockFlows()
                    wire_ms += last.wire_ms
                    block_ms += ev.block_ms
                    shard = shard_now()
                    sh = block_delta(shard_prev, shard)
                    shard_prev = shard
                    # measured where a collective was timed, else priced (and marked so)
                    self._publish_block(
                        msg.request_id, ev, last,
                        probe=bool(self.f3_probe_width) and self._drafts.feature_tap is None,
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
            self._drafts.close_tap()
        flows, failures = FlowStats(), []
        if remote is not None:
            flows, failures = remote.flow_stats(), remote.failures
        elif isinstance(proposer, RemoteProposerGroup):
            flows, failures = proposer.flow_stats(), proposer.failures
        kv = self._kv_flow(staged, verifier, len(ids), stats.prefill_ms)
        fleet = FleetStats(verifier=self.node_id, flows=flows, proposer_failures=len(failures),
                           wire_ms=wire_ms, kv=kv,
                           multihost_overhead=multihost_overhead(wire_ms, block_ms),
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
