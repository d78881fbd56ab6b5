"""The single-session decode loops, kept as the tests' references (issue 49: the serving engine
is the one decode path; these are no part of macfleet). The tests that check a loop's own
contract (tests/engine/test_loop_contract.py, test_loop_events.py, test_tree_loop.py,
test_pipeline.py) and those that compare against it import them from here.

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

generate_from_ids / generate_local: the drivers that picked one of them (text in, text out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.ahead import Ahead, draft_ahead, take
from macfleet.engine.block import (BlockTally, accept_tree, chain_outcome, commit_block,
                                   tree_decided, tree_decision)
from macfleet.engine.constraint import (Constraint, Grammar, constrained_draft,
                                        constrained_tree, masked_logits, masked_tree_logits)
from macfleet.engine.controller import AUTO, DraftTokens, FixedDraftLength, make_controller
from macfleet.engine.conversation import ChatInput
from macfleet.engine.events import BlockDone, Event, Finished, TokensCommitted
from macfleet.engine.models import LoadedModel
from macfleet.engine.pipeline import drafts_ahead, padded_length, pads_blocks
from macfleet.engine.proposers import make_proposer
from macfleet.engine.proposers.base import (EMPTY_DRAFT, Draft, Proposer, ProposerFailed,
                                            sanitize_draft)
from macfleet.engine.proposers.eagle.features import record_hidden
from macfleet.engine.proposers.group import ProposerGroup, make_group, tree_of_drafts
from macfleet.engine.sampling import GREEDY, SamplingParams, generation_seed, make_rng
from macfleet.engine.text import (DEFAULT_MAX_TOKENS, Drafting, TextDelta, TextStream,
                                  encode_prompt, no_drafts, plan_drafting, with_text)
from macfleet.engine.tree import TokenTree, accept_tree_greedy, longest_branch
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


def verify_branches(verifier: Verifier, tree: TokenTree,
                    masks: np.ndarray | None = None) -> np.ndarray:
    """Argmax ids per node of `branch_rows` (greedy only). masks: [N+1, V] bool, the tokens
    allowed at each node (a grammar's); None: all."""
    rows = branch_rows(verifier, tree.tokens, tree.parents)
    if masks is not None:
        rows = mx.where(mx.array(masks), rows, float("-inf"))
    return np.array(mx.argmax(rows, axis=-1))


def _predraft(group: ProposerGroup, context: Sequence[int], tree: TokenTree,
              ks: Sequence[int]) -> list[Ahead | None] | None:
    """Every drafter's draft of the next block (engine/ahead.py), made while the device
    verified this one: from the context + the tree's longest path."""
    main = longest_branch(tree.parents)[1:]  # the deepest branch, without the root
    if not main:
        return None
    branch = tree.path_tokens(main)
    return [draft_ahead(p.propose, context, branch, k) if k > 0 and group.live[j] else None
            for j, (p, k) in enumerate(zip(group.proposers, ks))]


def _take_ahead(ahead: list[Ahead | None] | None,
                context: Sequence[int]) -> list[Draft | None] | None:
    """The drafts made ahead, re-rooted at the committed bonus token, if the block went as
    they assumed (its longest path accepted); None otherwise."""
    if ahead is None:
        return None
    out = [take(a, context) for a in ahead]
    return out if any(d is not None for d in out) else None


def _verify(verifier: Verifier, tree: TokenTree, tree_ok: bool, params: SamplingParams,
            rng, pad_to: int = 0, during=None, seed: int = 0,
            start: int = 0, constraint: Constraint | None = None) -> tuple[list[int], int]:
    """Verify the tree, run `during()` while the device computes it, keep the accepted path.
    Greedy and exact-match sampling decide on the device (sampling draws keyed by output
    position from `start`); drafts with probabilities take SpecInfer's rule on the host.
    constraint: every node's row masked by the grammar after its path."""
    base = verifier.offset
    if len(tree.tokens) == 1 and constraint is None and pad_to <= 1:
        # nothing drafted (plain decoding chosen, or every drafter backed off): the model's
        # own forward, tapped for hidden-state drafters, is cheaper than a tree's
        root = [tree.tokens[0]]
        logits = (verifier.forward_lazy(mx.array(root, dtype=mx.uint32))
                  if getattr(verifier, "pipelines", False) else verifier.forward(root))
        out = chain_outcome(EMPTY_DRAFT, logits, params, seed, start)
        mx.async_eval(out)
        if during is not None:
            during()
        return [], int(out.tolist()[1])
    if tree_ok:
        logits, hidden = tree_forward(verifier, tree, return_hidden=True, pad_to=pad_to)
        n = len(tree.tokens)
        logits = masked_tree_logits(constraint, logits, tree)
        # the decision left lazy (block.tree_decision: the serving engine's too), or the
        # logits for SpecInfer's host rule; `during` runs while the device computes it
        out = tree_decision(tree, logits, params, seed, start)
        mx.async_eval(out if out is not None else logits)
        if during is not None:
            during()
        if out is not None:
            path, nxt = tree_decided(tree, params, out.tolist())
        else:
            path, nxt = accept_tree(tree, logits[:n], params, rng, seed, start)
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
    pad_costs = costs if pads_blocks() else None
    ahead_ok = drafts_ahead()
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
    ahead: list[Ahead | None] | None = None
    try:
        while len(generated) < max_tokens and finish != "stop":
            t0 = time.perf_counter()
            ks = group.lengths(max_tokens - len(generated) - 1)
            given = _take_ahead(ahead, context)
            ahead = None
            drafts, tree = tree_of_drafts(context[-1], group.draft_all(context, ks, given), ks,
                                          vocab, params.greedy)
            if constraint is not None:  # forced tokens first, the tree cut to the grammar
                tree = constrained_tree(constraint, tree, max_tokens - len(generated) - 1)
            t1 = time.perf_counter()

            def during(tree=tree, ks=ks, context=context):
                nonlocal ahead
                if ahead_ok and group.host_side and len(generated) + tree.size + 1 < max_tokens:
                    ahead = _predraft(group, context, tree, ks)

            path, nxt = _verify(verifier, tree, tree_ok, params, rng,
                                padded_length(len(tree.tokens), pad_costs), during, seed,
                                len(generated), constraint)
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


def generate_from_ids(lm: LoadedModel, verifier, drafting: Drafting, ids: Sequence[int], *,
                      draft_tokens: DraftTokens = AUTO, max_tokens: int = DEFAULT_MAX_TOKENS,
                      params: SamplingParams = GREEDY, grammar: Grammar | None = None
                      ) -> Iterator[TextDelta | Event]:
    """The one generation driver (in-process and in the verifier agent): the tree loop for a
    group of drafters, the chain loop otherwise; TextDelta for each commit, BlockDone per block,
    the detokenizer's flush as a last TextDelta, then Finished. grammar: the answer must match
    it (issue 32: chains and trees cut to it, forced tokens drafted first, rows masked)."""
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
    """In-process speculative generation: TextDelta for each commit, BlockDone, then Finished.
    prompt: a text, or a conversation (conversation.Turn, ...) ending on a user turn."""
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
    yield from generate_from_ids(lm, verifier or Verifier(lm.model), drafting, ids,
                                 draft_tokens=draft_tokens, max_tokens=max_tokens, params=params,
                                 grammar=grammar)
