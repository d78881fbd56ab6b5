"""The acceptance rules on the host, kept as the tests' references (issue 49: macfleet decides on
the device, engine/pipeline.py, and keeps only SpecInfer's tree rule on the host,
engine/tree.py). Pure functions deciding how much of a draft block the verifier keeps.

Each returns (accepted, next_token): the first `accepted` drafts are committed, then the
verifier's correction or bonus token. Shapes: draft [k]; target rows [k + 1, V] (row i scores the
token after block input i). Greedy exact match, exact-match sampling and the ratio test, each
lossless: docs/engine.md, "Acceptance rules". `accept_chain`: a chain block's decision as
engine/block.py makes it, read back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.block import chain_outcome
from macfleet.engine.proposers.base import Draft
from macfleet.engine.sampling import SamplingParams, sample
from macfleet.engine.tree import residual


def accept_greedy(draft: Sequence[int], target_ids: Sequence[int]) -> tuple[int, int]:
    """target_ids: [k + 1] argmax of the verifier at each block position."""
    n = 0
    for d, t in zip(draft, target_ids):
        if int(d) != int(t):
            break
        n += 1
    return n, int(target_ids[n])


def accept_exact_sample(draft: Sequence[int], p: np.ndarray,
                        rng: np.random.Generator) -> tuple[int, int]:
    """p: [k + 1, V] verifier probabilities."""
    for i, d in enumerate(draft):
        y = sample(p[i], rng)
        if y != int(d):
            return i, y
    return len(draft), sample(p[len(draft)], rng)


def accept_ratio(draft: Sequence[int], q: np.ndarray, p: np.ndarray,
                 rng: np.random.Generator) -> tuple[int, int]:
    """q: [k, V] draft probabilities the tokens were sampled from; p: [k + 1, V]."""
    for i, d in enumerate(draft):
        d = int(d)
        qi = q[i, d]
        if qi <= 0.0 or rng.random() >= min(1.0, p[i, d] / qi):
            return i, sample(residual(p[i], q[i]), rng)
    return len(draft), sample(p[len(draft)], rng)


def accept_chain(draft: Draft, logits: mx.array, params: SamplingParams, seed: int, start: int,
                 target: Sequence[int] | None = None) -> tuple[int, int]:
    """(accepted drafts, next token) of a chain block [root, d_1 .. d_k] from the verifier's
    logits [k + 1, V]. target: the block's argmax ids when the caller computed them already
    (greedy only)."""
    if params.greedy and target is not None:
        return accept_greedy(draft.tokens, target)
    n, nxt = chain_outcome(draft, logits, params, seed, start).tolist()
    return int(n), int(nxt)
