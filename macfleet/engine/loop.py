"""The speculative decoding loop: a generator of typed events.

    prompt ids -> prefill -> [ propose k -> verify k+1 in one forward -> accept -> roll back ]*

Invariants (checked by tests on real models):
* greedy: the committed ids equal the verifier decoding alone, whatever the proposer returns;
* sampling: each committed token is distributed as the verifier's own (ratio test with draft
  probabilities, exact-match sampling without);
* the verifier's cache holds exactly the committed tokens minus the last one at every yield.
A proposer that raises or returns garbage costs speed, never correctness: its draft is
truncated to what is valid, or dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import mlx.core as mx

from macfleet.engine.ahead import Ahead, draft_ahead, take
from macfleet.engine.block import BlockTally, chain_outcome, commit_block
from macfleet.engine.constraint import Constraint, constrained_draft, masked_logits
from macfleet.engine.controller import FixedDraftLength
from macfleet.engine.events import BlockDone, Event, Finished, TokensCommitted
from macfleet.engine.pipeline import drafts_ahead, padded_length, pads_blocks
from macfleet.engine.proposers.base import (EMPTY_DRAFT, Draft, Proposer, ProposerFailed,
                                            sanitize_draft)
from macfleet.engine.sampling import GREEDY, SamplingParams, generation_seed
from macfleet.engine.verifier import Verifier
from macfleet.engine.verify_costs import verify_costs

log = logging.getLogger(__name__)

def speculative_generate(
    verifier: Verifier,
    proposer: Proposer | None,
    prompt: Sequence[int],
    *,
    params: SamplingParams = GREEDY,
    max_tokens: int = 256,
    controller=None,
    eos_ids: frozenset[int] = frozenset(),
    constraint: Constraint | None = None,
) -> Iterator[Event]:
    """Yield TokensCommitted and BlockDone events, then one Finished.

    constraint: the answer must match its grammar (issue 32, engine/constraint.py): the
    verifier's rows are masked, drafts cut to the grammar and its forced tokens drafted first;
    blocks are then read on the host, one at a time (no pipelined steps, no drafting ahead).

    Keeping the device busy (docs/design.md, physics 4), with the same output:
    * blocks are decided on the device (`pipeline.greedy_outcome`, `sampled_outcome`): one
      synchronisation per block, two integers back;
    * a run of plain steps is pipelined like mlx-lm's `generate_step`: step n+1's graph is
      built on step n's lazy argmax and started before step n is read (the price: a step
      computed past an end-of-sequence token, dropped from the cache);
    * a host-side drafter (`Proposer.host_side`) drafts the next block while the device
      verifies this one, from the outcome it expects; a wrong guess costs only that draft;
    * blocks are verified at the lengths the device runs fastest (`pipeline.padded_length`
      over its measured verify(L) table); the padding's cache entries are rolled back.
    """
    if not prompt:
        raise ValueError("empty prompt")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    vocab = int(verifier.model.args.vocab_size)
    if any(not 0 <= int(t) < vocab for t in prompt):
        raise ValueError(f"prompt has token ids outside the vocabulary (0..{vocab - 1})")
    controller = controller or FixedDraftLength(4 if proposer else 0)
    seed = 0 if params.greedy else generation_seed(params)

    def outcome(logits: mx.array, draft: Draft, start: int) -> mx.array:
        """The block's (accepted, next token), lazy: decided on the device."""
        return chain_outcome(draft, logits, params, seed, start)

    t_start = time.perf_counter()
    lazy = getattr(verifier, "pipelines", False) and constraint is None
    # blocks padded to the device's cheap lengths: a local verifier's own table (a sharded
    # one, whose forward involves its peers, is not probed from here)
    costs = (verify_costs(verifier.model) if proposer is not None and pads_blocks()
             and getattr(verifier, "pipelines", False) else None)
    verifier.reset()
    proposer_name = proposer.name if proposer is not None else "none"
    if proposer is not None:
        proposer.start(params)
    context = [int(t) for t in prompt]
    verifier.prefill(context[:-1])
    prefill_ms = (time.perf_counter() - t_start) * 1e3
    generated: list[int] = []
    tally = BlockTally()
    finish = "length"
    step: mx.array | None = None  # a plain step already started on the device (lazy token)
    k_next: int | None = None  # the next block's length, when asked for before this one ended
    ahead: Ahead | None = None
    k_pre = int(getattr(controller, "k_max", None) or getattr(controller, "k", 0) or 0)
    ahead_ok = drafts_ahead() and constraint is None
    paced = proposer is not None and proposer.paced
    try:
        while len(generated) < max_tokens:
            t0 = time.perf_counter()
            draft = EMPTY_DRAFT
            if step is not None:  # started while the previous plain step ran
                k, out, L = 0, step, 1
                step = None
                t1 = t0
            else:
                k = controller.next_k() if k_next is None else k_next
                k = min(k, max_tokens - len(generated) - 1)
                if proposer is not None and k > 0:
                    got = take(ahead, context, k)
                    draft = sanitize_draft(got, k, vocab) if got is not None else EMPTY_DRAFT
                    if not draft.tokens:
                        try:
                            draft = sanitize_draft(proposer.propose(context, k), k, vocab)
                        except ProposerFailed as e:
                            log.warning("proposer %s failed (%s): continuing without it",
                                        proposer.name, e)
                            proposer = None
                ahead = None
                if constraint is not None:  # forced tokens first, cut to the grammar
                    draft = Draft(constrained_draft(constraint, draft.tokens,
                                                    max_tokens - len(generated) - 1))
                t1 = time.perf_counter()
                block_in = [context[-1], *draft.tokens]
                L = padded_length(len(block_in), costs) if draft.tokens else 1
                block_in += [block_in[-1]] * (L - len(block_in))
                if lazy:
                    logits = verifier.forward_lazy(mx.array(block_in, dtype=mx.uint32))
                else:
                    logits = verifier.forward(block_in)[: len(draft) + 1]  # [k + 1, V]
                # a grammar masks the rows (on the host's masks; blocks are then synchronous)
                out = outcome(masked_logits(constraint, logits, draft.tokens), draft,
                              len(generated))
                mx.async_eval(out)
            # while the device verifies: start the next plain step on this one's lazy token,
            # or draft the next block on the host from the outcome the drafter expects
            k_next = None
            if lazy and not draft.tokens and len(generated) + 1 < max_tokens:
                k_next = controller.next_k()
                if k_next == 0:
                    step = outcome(verifier.forward_lazy(out[1:]), EMPTY_DRAFT,
                                   len(generated) + 1)
                    mx.async_eval(step)
            elif (ahead_ok and proposer is not None and proposer.host_side and draft.tokens
                  and k_pre and len(generated) + len(draft) + 1 < max_tokens):
                ahead = draft_ahead(proposer.propose, context, draft.tokens, k_pre)
            n, nxt = (int(v) for v in out.tolist())
            verifier.rollback(L - 1 - n)
            t2 = time.perf_counter()
            new, stopped = commit_block([*draft.tokens[:n], nxt], eos_ids, constraint)
            if stopped:
                finish = "stop"
            context.extend(new)
            generated.extend(new)
            dms, vms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            tally.record(len(draft), n, dms, vms)
            # a paced drafter's wait is its own decision, not a per-token drafting cost
            controller.observe(len(draft), n, 0.0 if paced else dms, vms)
            if proposer is not None and draft.tokens:  # a drafter that paces itself learns
                proposer.observe(len(draft), n, vms, L)
            if new:
                yield TokensCommitted(tally.blocks, tuple(new))
            yield BlockDone(block=tally.blocks, k=k, drafted=len(draft), accepted=n,
                            committed=len(new), draft_ms=dms, verify_ms=vms,
                            block_ms=(time.perf_counter() - t0) * 1e3)
            if finish == "stop":
                break
    finally:
        if step is not None:  # a step started past the end: its entry leaves the cache
            mx.eval(step)
            verifier.rollback(1)
        if proposer is not None:
            proposer.close()
    stats = tally.stats(tokens=len(generated), elapsed_s=time.perf_counter() - t_start,
                        prefill_ms=prefill_ms, proposer=proposer_name, finish_reason=finish)
    yield Finished(stats, tuple(generated))


