"""One speculative block's host-side decisions, shared by every loop that verifies blocks:

    draft -> verify (the caller's forward) -> accept -> cut at a stop token -> tally

Sampling decides on the device (engine/pipeline.py, keyed by seed and output position, so a
seeded request draws alike in every loop); only SpecInfer's rule for trees of drafts with
probabilities runs on the host (`tree.accept_tree_sample`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from macfleet.engine.pipeline import greedy_outcome, sampled_outcome, sampled_tree_outcome
from macfleet.engine.proposers.base import Draft
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.tree import TokenTree, accept_tree_greedy
from macfleet.stats import GenerationStats, ProposerStats

if TYPE_CHECKING:
    from macfleet.engine.constraint import Constraint


def chain_outcome(draft: Draft, logits: mx.array, params: SamplingParams, seed: int,
                  start: int) -> mx.array:
    """A chain block's decision as a lazy int32 [2] (accepted, next token), on the device.
    start: the output position of the block's first new token (sampled draws are keyed by it)."""
    if params.greedy:
        return greedy_outcome(logits, draft.tokens)
    return sampled_outcome(logits, draft.tokens, draft.probs, params, seed, start)


def tree_outcome(tree: TokenTree, logits: mx.array, params: SamplingParams, seed: int,
                 start: int) -> mx.array | None:
    """A sampled tree's decision as a lazy int32 [2] (deepest accepted node, next token) when
    its drafts carry no probabilities; None when they do (SpecInfer's rule, on the host)."""
    if any(c.q is not None for cands in tree.candidates for c in cands):
        return None
    return sampled_tree_outcome(logits, tree.tokens, tree.parents, tree.depths, params, seed,
                                start)


def tree_decision(tree: TokenTree, logits: mx.array, params: SamplingParams, seed: int,
                  start: int) -> mx.array | None:
    """A tree block's decision left lazy, to be evaluated with other blocks' (one host
    synchronisation for many): greedy, the argmax at every node [N] (the walk is a host
    loop over integers); sampled, `tree_outcome`'s [2]; None for SpecInfer's host rule."""
    if params.greedy:
        return mx.argmax(logits[: len(tree.tokens)], axis=-1)
    return tree_outcome(tree, logits, params, seed, start)


def tree_decided(tree: TokenTree, params: SamplingParams, values: Sequence[int]
                 ) -> tuple[list[int], int]:
    """The accepted node path and next token from `tree_decision`'s evaluated values."""
    if params.greedy:
        return accept_tree_greedy(tree, values)
    node, nxt = values
    return node_path(tree, int(node)), int(nxt)


def node_path(tree: TokenTree, node: int) -> list[int]:
    """The drafted nodes from the root's child down to `node` (none for the root)."""
    out = []
    while node > 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


def cut_at_stop(new: Sequence[int], eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """A block's committed tokens up to (not including) the first stop token, and whether
    one was there."""
    stop_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
    if stop_at is None:
        return list(new), False
    return list(new[:stop_at]), True


def commit_block(new: Sequence[int], eos_ids: frozenset[int], constraint: Constraint | None
                 ) -> tuple[list[int], bool]:
    """A verified block's tokens as the answer takes them, cut at the first stop token, then at
    the grammar's end (the constraint advances over what is kept); and whether it stopped."""
    new, stopped = cut_at_stop(new, eos_ids)
    if constraint is not None:
        end = constraint.commit(new)
        if end is not None:
            new, stopped = new[:end], True
    return new, stopped


@dataclass
class BlockTally:
    """One generation's block statistics, reduced to its `GenerationStats`."""

    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    hist: list[int] = field(default_factory=list)  # drafted blocks by accepted length

    def record(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        """One verified block (drafted: its draft tokens; 0 for a plain step)."""
        self.blocks += 1
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            if accepted >= len(self.hist):
                self.hist.extend([0] * (accepted + 1 - len(self.hist)))
            self.hist[accepted] += 1
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms

    def stats(self, *, tokens: int, elapsed_s: float, prefill_ms: float, proposer: str,
              finish_reason: str, per_proposer: tuple[ProposerStats, ...] = (),
              **chosen) -> GenerationStats:
        """chosen: `drafters`, `choices` and `trace` of a drafter chosen while it runs."""
        return GenerationStats(
            tokens=tokens, elapsed_s=elapsed_s, prefill_ms=prefill_ms, blocks=self.blocks,
            drafted=self.drafted, accepted=self.accepted, draft_ms=self.draft_ms,
            verify_ms=self.verify_ms, proposer=proposer, finish_reason=finish_reason,
            accepted_hist=tuple(self.hist), per_proposer=per_proposer, **chosen)
