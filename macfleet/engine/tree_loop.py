"""N proposers : 1 verifier. Every block, each proposer drafts a chain; the chains are merged
into a token tree and verified in ONE forward; the longest accepted path wins.

Each proposer has its own adaptive draft length (its own acceptance and cost), so a useless
proposer is pruned to k = 0 (probed now and then) and a good one grows. The tree is capped at
`node_budget` nodes: verify(L) is sublinear but not free. Events and statistics are the same as
the chain loop's, plus per-proposer acceptance in `stats.per_proposer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import mlx.core as mx

from macfleet.engine.ahead import Ahead, draft_ahead, take
from macfleet.engine.block import (BlockTally, accept_tree, chain_outcome, commit_block,
                                   tree_decided, tree_decision)
from macfleet.engine.constraint import Constraint, constrained_tree, masked_tree_logits
from macfleet.engine.events import BlockDone, Event, Finished, TokensCommitted
from macfleet.engine.pipeline import drafts_ahead, padded_length, pads_blocks
from macfleet.engine.proposers.base import EMPTY_DRAFT
from macfleet.engine.proposers.group import ProposerGroup, tree_of_drafts
from macfleet.engine.proposers.eagle.features import record_hidden
from macfleet.engine.sampling import GREEDY, SamplingParams, generation_seed, make_rng
from macfleet.engine.tree import TokenTree, accept_tree_greedy, longest_branch
from macfleet.engine.tree_verify import (compact_cache, supports_tree_attention, tree_forward,
                                         verify_branches)
from macfleet.engine.verifier import Verifier
from macfleet.engine.verify_costs import verify_costs

log = logging.getLogger(__name__)

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
                  params: SamplingParams = GREEDY, max_tokens: int = 256,
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
