"""One speculative block's host-side decisions, shared by every loop that verifies blocks.

    draft -> verify (the caller's forward) -> accept -> cut at a stop token -> tally

The single-session loops (`loop.speculative_generate`, `tree_loop.tree_generate`) and the
serving engine (`serve/decode.py`, one block per session per iteration) differ in how they run
the forward; what they decide from its logits is written once, here:

* `accept_chain` / `accept_tree`: the acceptance rule of a chain or a token tree for the
  request's sampling parameters (greedy exact match, the ratio test, exact-match sampling);
  a greedy caller may pass the argmax ids it already has (one host synchronisation for many);
* `cut_at_stop`: a block's committed tokens end before the first stop token;
* `BlockTally`: a generation's block statistics, reduced to its `GenerationStats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from macfleet.engine.acceptance import accept_exact_sample, accept_greedy, accept_ratio
from macfleet.engine.proposers.base import Draft
from macfleet.engine.sampling import SamplingParams, probs_from_logits
from macfleet.engine.tree import TokenTree, accept_tree_greedy, accept_tree_sample
from macfleet.stats import GenerationStats, ProposerStats


def accept_chain(draft: Draft, logits: mx.array, params: SamplingParams, rng,
                 target: Sequence[int] | None = None) -> tuple[int, int]:
    """(accepted drafts, next token) of a chain block [root, d_1 .. d_k] from the verifier's
    logits [k + 1, V]. target: the block's argmax ids when the caller computed them already
    (greedy only)."""
    if params.greedy:
        return accept_greedy(draft.tokens, target if target is not None else
                             np.array(mx.argmax(logits, axis=-1)).tolist())
    probs = probs_from_logits(logits, params)
    if draft.probs is not None:
        return accept_ratio(draft.tokens, draft.probs, probs, rng)
    return accept_exact_sample(draft.tokens, probs, rng)


def accept_tree(tree: TokenTree, logits: mx.array, params: SamplingParams, rng,
                target: Sequence[int] | None = None) -> tuple[list[int], int]:
    """The accepted node path and the next token, from the verifier's logits at every node;
    target: the argmax ids at every node when the caller computed them already (greedy)."""
    if params.greedy:
        return accept_tree_greedy(tree, target if target is not None else
                                  np.array(mx.argmax(logits, axis=-1)).tolist())
    return accept_tree_sample(tree, probs_from_logits(logits, params), rng)


def cut_at_stop(new: Sequence[int], eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """A block's committed tokens up to (not including) the first stop token, and whether
    one was there."""
    stop_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
    if stop_at is None:
        return list(new), False
    return list(new[:stop_at]), True


@dataclass
class BlockTally:
    """One generation's blocks: how many, drafts verified and accepted, the histogram of
    accepted lengths of the blocks that drafted, and the time spent drafting and verifying."""

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
              finish_reason: str, per_proposer: tuple[ProposerStats, ...] = ()
              ) -> GenerationStats:
        return GenerationStats(
            tokens=tokens, elapsed_s=elapsed_s, prefill_ms=prefill_ms, blocks=self.blocks,
            drafted=self.drafted, accepted=self.accepted, draft_ms=self.draft_ms,
            verify_ms=self.verify_ms, proposer=proposer, finish_reason=finish_reason,
            accepted_hist=tuple(self.hist), per_proposer=per_proposer)
