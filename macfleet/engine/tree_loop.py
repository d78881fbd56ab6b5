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
from macfleet.engine.controller import AdaptiveDraftLength, FixedDraftLength
from macfleet.engine.events import BlockDone, Event, Finished, TokensCommitted
from macfleet.engine.loop import sanitize_draft
from macfleet.engine.pipeline import drafts_ahead, padded_length, pads_blocks
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer, ProposerFailed
from macfleet.engine.proposers.eagle.features import record_hidden
from macfleet.engine.sampling import GREEDY, SamplingParams, generation_seed, make_rng
from macfleet.engine.tree import TokenTree, accept_tree_greedy, longest_branch
from macfleet.engine.tree_verify import (compact_cache, supports_tree_attention, tree_forward,
                                         verify_branches)
from macfleet.engine.verifier import Verifier
from macfleet.engine.verify_costs import verify_costs
from macfleet.stats import ProposerStats

log = logging.getLogger(__name__)

DEFAULT_NODE_BUDGET = 16
DEFAULT_K_MAX = 8


TREE_DRAFTER_BUDGET = 24  # nodes a dynamic-tree drafter may use (it picks its own size)


def cap_total(ks: Sequence[int], total: int) -> list[int]:
    """Draft lengths cut (largest first) until they sum to at most `total`."""
    ks = list(ks)
    while sum(ks) > max(total, 0):
        ks[ks.index(max(ks))] -= 1
    return ks


def tree_of_drafts(root: int, drafts: Sequence[Draft], ks: Sequence[int], vocab: int,
                   greedy: bool) -> tuple[list[Draft], TokenTree]:
    """A block's drafts, sanitized (and without draft probabilities when greedy: acceptance
    does not read them), merged into its token tree under `root`."""
    drafts = [sanitize_draft(d, k, vocab) for d, k in zip(drafts, ks)]
    if greedy:
        drafts = [Draft(d.tokens, None, d.draft_ms, d.parents) for d in drafts]
    return drafts, TokenTree.from_drafts(root, [d.tokens for d in drafts],
                                         [d.probs for d in drafts], [d.parents for d in drafts])


def tree_budget(proposers: Sequence[Proposer]) -> int:
    """The node budget of a group: room for a dynamic tree when one of them drafts trees."""
    return max([DEFAULT_NODE_BUDGET, *(TREE_DRAFTER_BUDGET for p in proposers if p.drafts_trees)])


def _own_or(k: int | None, controller) -> int:
    return controller.next_k() if k is None else k


class ProposerGroup:
    """Proposers drafting for one sequence. `draft_all` is sequential here; a remote group
    (agents) sends every request first and then collects, so drafting runs in parallel."""

    choice = None  # a group that chooses its drafter per block (engine/choosing.py): this one's
    choices: Sequence = ()
    trace: Sequence = ()  # ... and what it saw (stats.BlockTrace)

    def __init__(self, proposers: Sequence[Proposer], *, draft_tokens: int | str = "auto",
                 k_max: int = DEFAULT_K_MAX, node_budget: int = DEFAULT_NODE_BUDGET) -> None:
        if not proposers:
            raise ValueError("a proposer group needs at least one proposer")
        self.proposers = list(proposers)
        self.node_budget = node_budget
        self.controllers = [AdaptiveDraftLength(k_max=k_max) if draft_tokens == "auto"
                            else FixedDraftLength(int(draft_tokens)) for _ in proposers]
        self.live = [True] * len(proposers)
        self.drafted = [0] * len(proposers)
        self.accepted = [0] * len(proposers)

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.proposers)

    def start(self, params: SamplingParams) -> None:
        for p in self.proposers:
            p.start(params)

    def lengths(self, limit: int) -> list[int]:
        """Draft length per proposer; a tree drafter gets the node budget (it picks its own
        size within it) and shares it with the others."""
        ks = [0 if not live else min(self.node_budget if p.drafts_trees else
                                     _own_or(p.draft_length(), c), limit)
              for p, c, live in zip(self.proposers, self.controllers, self.live)]
        return cap_total(ks, self.node_budget)

    def draft_all(self, context: Sequence[int], ks: Sequence[int],
                  given: Sequence[Draft | None] | None = None) -> list[Draft]:
        """Each proposer's draft (EMPTY_DRAFT where k is 0 or it failed: pruned); a non-empty
        `given[j]` (drafted ahead) stands for proposer j's, which is then not asked."""
        given = list(given) if given is not None else [None] * len(self.proposers)
        have = [g is not None and bool(g.tokens) and self.live[j] for j, g in enumerate(given)]
        self.begin(context, [0 if h else k for h, k in zip(have, ks)])
        out = self.finish()
        return [given[j] if h else d for j, (h, d) in enumerate(zip(have, out))]

    @property
    def host_side(self) -> bool:
        """Every live drafter drafts on the host: the group may draft during verification."""
        return any(self.live) and all(p.host_side for p, live in zip(self.proposers, self.live)
                                      if live)

    def begin(self, context: Sequence[int], ks: Sequence[int]) -> None:
        """Every proposer's request first (`Proposer.begin`: drafters on other machines
        draft at the same time, and a batching verifier begins every session's group before
        finishing any); `finish` collects them."""
        self._begun: list[int] = []
        for j, (p, k) in enumerate(zip(self.proposers, ks)):
            if k > 0 and self.live[j]:
                try:
                    p.begin(context, k)
                    self._begun.append(j)
                except ProposerFailed as e:
                    self._fail(j, e)

    def finish(self) -> list[Draft]:
        out = [EMPTY_DRAFT] * len(self.proposers)
        for j in self._begun:
            try:
                out[j] = self.proposers[j].finish()
            except ProposerFailed as e:
                self._fail(j, e)
        self._begun = []
        return out

    def _fail(self, j: int, e: Exception) -> None:
        log.warning("proposer %s failed (%s): pruned from the tree", self.proposers[j].name, e)
        self.live[j] = False

    def seed_verify_costs(self, costs) -> None:
        for p in self.proposers:
            p.seed_verify_costs(costs)

    def observe(self, drafts: Sequence[Draft], accepted: Sequence[int], verify_ms: float,
                verified: int | None = None) -> None:
        for j, (p, c, d, n) in enumerate(zip(self.proposers, self.controllers, drafts,
                                              accepted)):
            c.observe(len(d), n, d.draft_ms, verify_ms)
            p.observe(len(d), n, verify_ms, verified)
            self.drafted[j] += len(d)
            self.accepted[j] += n

    def close(self) -> None:
        for p in self.proposers:
            p.close()

    def drafter_stats(self) -> tuple:
        """Each candidate's blocks, when the group chooses its drafter per block."""
        return ()

    def per_proposer(self) -> tuple[ProposerStats, ...]:
        return tuple(ProposerStats(p.name, d, a)
                     for p, d, a in zip(self.proposers, self.drafted, self.accepted))


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
