"""The single-session decode loops, kept as the tests' references (issue 49: the serving engine
is the one decode path; these are no part of macfleet). Tests compare the engine and the agents
against them (greedy ids, seeded draws, a grammar's answer) and check a drafter's output
through them; they are as small as those comparisons allow: each block is read back before the
next is built (no pipelined steps, no padded blocks, no drafting ahead).

speculative_generate, the chain loop:
    The speculative decoding loop: a generator of typed events.

        prompt ids -> prefill -> [ propose k -> verify k+1 in one forward -> accept -> roll back ]*

    Invariants (checked by tests on real models):
    * greedy: the committed ids equal the verifier decoding alone, whatever the proposer returns;
    * sampling: each committed token is distributed as the verifier's own (ratio test with draft
      probabilities, exact-match sampling without);
    * the verifier's cache holds exactly the committed tokens minus the last one at every yield.
    A proposer that raises or returns garbage costs speed, never correctness: its draft is
    truncated to what is valid, or dropped.

tree_generate, the tree loop:
    N proposers : 1 verifier. Every block, each proposer drafts a chain; the chains are merged
    into a token tree and verified in ONE forward; the longest accepted path wins.

    Each proposer has its own adaptive draft length (its own acceptance and cost), so a useless
    proposer is pruned to k = 0 (probed now and then) and a good one grows. The tree is capped at
    `node_budget` nodes: verify(L) is sublinear but not free. Events and statistics are the same as
    the chain loop's, plus per-proposer acceptance in `stats.per_proposer`.

generate_local: the driver that picks one of them (text in, text out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.block import (BlockTally, chain_outcome, commit_block, tree_decided,
                                   tree_decision)
from macfleet.engine.constraint import (Constraint, Grammar, constrained_draft,
                                        constrained_tree, masked_logits, masked_tree_logits)
from macfleet.engine.controller import AUTO, DraftTokens, FixedDraftLength, make_controller
from macfleet.engine.conversation import ChatInput
from macfleet.engine.events import BlockDone, Event, Finished, TokensCommitted
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import make_proposer
from macfleet.engine.proposers.base import (EMPTY_DRAFT, Draft, Proposer, ProposerFailed,
                                            sanitize_draft)
from macfleet.engine.proposers.eagle import features
from macfleet.engine.proposers.group import ProposerGroup, make_group, tree_of_drafts
from macfleet.engine.sampling import (GREEDY, SamplingParams, generation_seed, make_rng,
                                      probs_from_logits)
from macfleet.engine.text import (DEFAULT_MAX_TOKENS, Drafting, TextDelta, TextStream,
                                  encode_prompt, no_drafts, plan_drafting, with_text)
from macfleet.engine.tree import TokenTree, accept_tree_greedy, accept_tree_sample
from macfleet.engine.tree_verify import (branch_rows, compact_cache, supports_tree_attention,
                                         tree_forward)
from macfleet.engine.verifier import Verifier
from macfleet.engine.verify_costs import verify_costs

log = logging.getLogger(__name__)


def speculative_generate(
    verifier: Verifier,
    proposer: Proposer | None,
    prompt: Sequence[int],
    *,
    params: SamplingParams = GREEDY,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    controller=None,
    eos_ids: frozenset[int] = frozenset(),
    constraint: Constraint | None = None,
) -> Iterator[Event]:
    """Yield TokensCommitted and BlockDone events, then one Finished.

    constraint: the answer must match its grammar (issue 32, engine/constraint.py): the
    verifier's rows are masked, drafts cut to the grammar and its forced tokens drafted first.
    Each block is read back before the next is built (the serving engine is the one that keeps
    the device busy); the decisions are engine/block.py's, on the device.
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
    t_start = time.perf_counter()
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
    paced = proposer is not None and proposer.paced
    try:
        while len(generated) < max_tokens:
            t0 = time.perf_counter()
            draft = EMPTY_DRAFT
            k = min(controller.next_k(), max_tokens - len(generated) - 1)
            if proposer is not None and k > 0:
                try:
                    draft = sanitize_draft(proposer.propose(context, k), k, vocab)
                except ProposerFailed as e:
                    log.warning("proposer %s failed (%s): continuing without it",
                                proposer.name, e)
                    proposer = None
            if constraint is not None:  # forced tokens first, cut to the grammar
                draft = Draft(constrained_draft(constraint, draft.tokens,
                                                max_tokens - len(generated) - 1))
            t1 = time.perf_counter()
            logits = verifier.forward([context[-1], *draft.tokens])  # [k + 1, V]
            n, nxt = (int(v) for v in chain_outcome(
                draft, masked_logits(constraint, logits, draft.tokens), params, seed,
                len(generated)).tolist())
            verifier.rollback(len(draft) - n)
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
                proposer.observe(len(draft), n, vms, len(draft) + 1)
            if new:
                yield TokensCommitted(tally.blocks, tuple(new))
            yield BlockDone(block=tally.blocks, k=k, drafted=len(draft), accepted=n,
                            committed=len(new), draft_ms=dms, verify_ms=vms,
                            block_ms=(time.perf_counter() - t0) * 1e3)
            if finish == "stop":
                break
    finally:
        if proposer is not None:
            proposer.close()
    stats = tally.stats(tokens=len(generated), elapsed_s=time.perf_counter() - t_start,
                        prefill_ms=prefill_ms, proposer=proposer_name, finish_reason=finish)
    yield Finished(stats, tuple(generated))


def record_hidden(model, start: int, tokens: Sequence[int], h: mx.array) -> None:
    """Report hidden rows computed outside the model's own forward (the tree forward runs the
    layers itself): rows of positions start.. for `tokens`, to the tap on this model, if any
    (eagle/features.py `attach_tap`)."""
    inner = getattr(model, "model", None)
    tap = inner.__dict__.get(features._TAP) if inner is not None else None
    if tap is not None:
        tap.records.append((start, [int(t) for t in tokens], h))


def verify_branches(verifier: Verifier, tree: TokenTree,
                    masks: np.ndarray | None = None) -> np.ndarray:
    """Argmax ids per node of `branch_rows` (greedy only). masks: [N+1, V] bool, the tokens
    allowed at each node (a grammar's); None: all."""
    rows = branch_rows(verifier, tree.tokens, tree.parents)
    if masks is not None:
        rows = mx.where(mx.array(masks), rows, float("-inf"))
    return np.array(mx.argmax(rows, axis=-1))


def _verify(verifier: Verifier, tree: TokenTree, tree_ok: bool, params: SamplingParams,
            rng, seed: int = 0, start: int = 0,
            constraint: Constraint | None = None) -> tuple[list[int], int]:
    """Verify the tree and keep the accepted path.
    Greedy and exact-match sampling decide on the device (sampling draws keyed by output
    position from `start`); drafts with probabilities take SpecInfer's rule on the host.
    constraint: every node's row masked by the grammar after its path."""
    base = verifier.offset
    if len(tree.tokens) == 1 and constraint is None:
        # nothing drafted (plain decoding chosen, or every drafter backed off): the model's
        # own forward, tapped for hidden-state drafters, is cheaper than a tree's
        logits = verifier.forward([tree.tokens[0]])
        return [], int(chain_outcome(EMPTY_DRAFT, logits, params, seed, start).tolist()[1])
    if tree_ok:
        logits, hidden = tree_forward(verifier, tree, return_hidden=True)
        n = len(tree.tokens)
        logits = masked_tree_logits(constraint, logits, tree)
        # the serving engine's decision (block.tree_decision), or SpecInfer's host rule
        out = tree_decision(tree, logits, params, seed, start)
        if out is not None:
            path, nxt = tree_decided(tree, params, out.tolist())
        else:
            path, nxt = accept_tree_sample(tree, probs_from_logits(logits[:n], params), rng)
        compact_cache(verifier, base, path)
        # hidden-state drafters read the verifier's features through a tap on its forward;
        # the tree forward runs the layers itself, so report the kept rows (root + path)
        record_hidden(verifier.model, base, [tree.tokens[0], *tree.path_tokens(path)],
                      hidden[mx.array([0, *path], dtype=mx.int32)])
        return path, nxt
    masks = constraint.tree_masks(tree.tokens, tree.parents) if constraint else None
    path, nxt = accept_tree_greedy(tree, verify_branches(verifier, tree, masks).tolist())
    verifier.forward([tree.tokens[0], *tree.path_tokens(path)])  # refill the accepted entries
    return path, nxt


def tree_generate(verifier: Verifier, group: ProposerGroup, prompt: Sequence[int], *,
                  params: SamplingParams = GREEDY, max_tokens: int = DEFAULT_MAX_TOKENS,
                  eos_ids: frozenset[int] = frozenset(),
                  constraint: Constraint | None = None) -> Iterator[Event]:
    """Yield TokensCommitted and BlockDone events, then one Finished (the chain loop's).

    constraint: the answer must match its grammar (issue 32), as in `speculative_generate`:
    each block's tree is cut to it with its forced tokens first (`constrained_tree`), every
    node's row masked after its path, and its end is a stop."""
    if not prompt:
        raise ValueError("empty prompt")
    vocab = int(verifier.model.args.vocab_size)
    # a tree is verified in the verifier's own KV cache: one whose layers run on other ranks
    # (a sharded verifier) keeps none here, and its model's forward must not run on this rank
    # alone (supports_tree_attention probes it): each branch is verified as a chain instead
    tree_ok = hasattr(verifier, "cache") and supports_tree_attention(verifier.model)
    if not tree_ok and not params.greedy:
        raise ValueError("sampling with several proposers needs tree attention (llama family)")
    rng = make_rng(params, stream=0)
    seed = 0 if params.greedy else generation_seed(params)
    costs = verify_costs(verifier.model)  # measured once per machine (cached), not timed here
    t_start = time.perf_counter()
    verifier.reset()
    group.start(params)
    group.seed_verify_costs(costs)
    context = [int(t) for t in prompt]
    verifier.prefill(context[:-1])
    prefill_ms = (time.perf_counter() - t_start) * 1e3
    generated: list[int] = []
    tally = BlockTally()
    finish = "length"
    try:
        while len(generated) < max_tokens and finish != "stop":
            t0 = time.perf_counter()
            ks = group.lengths(max_tokens - len(generated) - 1, context)
            group.begin(context, ks)
            drafts, tree = tree_of_drafts(context[-1], group.finish(), ks, vocab, params.greedy)
            if constraint is not None:  # forced tokens first, the tree cut to the grammar
                tree = constrained_tree(constraint, tree, max_tokens - len(generated) - 1)
            t1 = time.perf_counter()
            path, nxt = _verify(verifier, tree, tree_ok, params, rng, seed, len(generated),
                                constraint)
            t2 = time.perf_counter()
            new, stopped = commit_block([*tree.path_tokens(path), nxt], eos_ids, constraint)
            if stopped:
                finish = "stop"
            context.extend(new)
            generated.extend(new)
            dms, vms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            tally.record(tree.size, len(path), dms, vms)
            choice = group.choice
            group.observe(drafts, tree.accepted_per_source(path), vms, len(tree.tokens))
            if new:
                yield TokensCommitted(tally.blocks, tuple(new))
            yield BlockDone(block=tally.blocks, k=sum(ks), drafted=tree.size, accepted=len(path),
                            committed=len(new), draft_ms=dms, verify_ms=vms,
                            block_ms=(time.perf_counter() - t0) * 1e3,
                            drafter=choice.drafter if choice else "",
                            why=choice.why if choice else "")
    finally:
        group.close()
    stats = tally.stats(tokens=len(generated), elapsed_s=time.perf_counter() - t_start,
                        prefill_ms=prefill_ms, proposer=group.name, finish_reason=finish,
                        per_proposer=group.per_proposer(), drafters=group.drafter_stats(),
                        choices=tuple(group.choices), trace=tuple(group.trace))
    yield Finished(stats, tuple(generated))


def generate_local(
    lm: LoadedModel,
    prompt: ChatInput,
    *,
    chat: bool = True,
    proposer: str = "ngram",
    draft_tokens: DraftTokens = AUTO,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    params: SamplingParams = GREEDY,
    verifier: Verifier | None = None,
    grammar: Grammar | None = None,
) -> Iterator[TextDelta | Event]:
    """In-process speculative generation: TextDelta for each commit, BlockDone, then Finished
    (the tree loop for a group of drafters, the chain loop otherwise). prompt: a text, or a
    conversation (conversation.Turn, ...) ending on a user turn; grammar: the answer must match
    it (chains and trees cut to it, forced tokens drafted first, rows masked)."""
    ids = encode_prompt(lm.tokenizer, prompt, chat)

    def make(spec: str) -> Proposer | None:
        return make_proposer(spec, lm)

    if proposer == AUTO:  # chosen block by block (engine/choosing.py)
        from macfleet.engine.choosing import auto_spec, make_auto_group

        proposer = auto_spec(lm)
    if proposer == AUTO:
        drafting: Drafting = make_auto_group(lm, draft_tokens)
    else:
        drafting = plan_drafting(proposer, chain=make, tree=lambda specs: make_group(
            [make(s) or no_drafts(s) for s in specs], draft_tokens))
    verifier = verifier or Verifier(lm.model)
    constraint = Constraint(grammar, lm.tokenizer, lm.vocab_size) if grammar else None
    if isinstance(drafting, ProposerGroup):
        events = tree_generate(verifier, drafting, ids, params=params, max_tokens=max_tokens,
                               eos_ids=lm.eos_ids, constraint=constraint)
    else:
        controller = make_controller(draft_tokens if drafting is not None else 0)
        events = speculative_generate(verifier, drafting, ids, params=params,
                                      max_tokens=max_tokens, controller=controller,
                                      eos_ids=lm.eos_ids, constraint=constraint)
    yield from with_text(events, TextStream(lm.tokenizer))
