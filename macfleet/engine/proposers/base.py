"""The proposer interface.

A proposer is told the whole committed context on every call (`propose(context, k)`) and keeps
whatever state it wants (a KV cache of the prefix it has seen): it finds the common prefix with
what it has cached and rolls back the rest. Passing the full context keeps the contract
stateless for the caller, which is what lets a remote proposer pre-draft speculatively
(cross-round drafting) and recover from any mismatch by itself; over the wire only the
committed delta (flow F1) travels, and the agent rebuilds the context.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from macfleet.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Draft tokens and, when the proposer sampled them, the distributions they came from."""

    tokens: tuple[int, ...]
    probs: np.ndarray | None = field(default=None, compare=False)  # [len(tokens), V]
    draft_ms: float = 0.0
    # A token tree instead of a chain: parents[i] is the index of token i's parent in
    # `tokens` (-1: a child of the last committed token); parents precede their children.
    parents: tuple[int, ...] | None = None
    # drafted together with other sessions' chains (`draft_together`): what one draft position
    # after the first took for all of them (the first also runs the tokens committed since the
    # last draft); None: not measured (one position, or drafted alone)
    step_ms: float | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(tokens=())


def _tree_prefix(parents: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
    """The longest prefix of `parents` (at most n) in which every parent precedes its child."""
    if parents is None:
        return None
    out: list[int] = []
    for i, p in enumerate(list(parents)[:n]):
        if not isinstance(p, (int, np.integer)) or not -1 <= int(p) < i:
            break
        out.append(int(p))
    return tuple(out)


def sanitize_draft(draft: Draft, k: int, vocab: int) -> Draft:
    """Keep the longest valid prefix of a draft; drop probabilities that are not a [n, V] pmf.

    A tree draft (parents) keeps the prefix of nodes whose tokens and parents are valid."""
    toks: list[int] = []
    for t in draft.tokens[:k]:
        if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab:
            break
        toks.append(int(t))
    parents = _tree_prefix(draft.parents, len(toks))
    if parents is not None:
        toks = toks[: len(parents)]
    probs = draft.probs
    if probs is not None:
        ok = (
            isinstance(probs, np.ndarray) and probs.ndim == 2 and probs.shape[1] == vocab
            and probs.shape[0] >= len(toks) and np.all(np.isfinite(probs[: len(toks)]))
            and np.all(probs[: len(toks)] >= 0)
            and np.allclose(probs[: len(toks)].sum(axis=1), 1.0, atol=1e-3)
        )
        probs = probs[: len(toks)].astype(np.float64) if ok else None
    if len(toks) == len(draft.tokens) and probs is draft.probs and parents == draft.parents:
        return draft
    return Draft(tuple(toks), probs, draft.draft_ms, parents)


def draft_together(jobs: Sequence[tuple[Proposer, Sequence[int], int]],
                   clock: Callable[[], float] = time.perf_counter) -> list[Draft]:
    """Chains of drafters whose caches are rows of one store (`Proposer.rows`), drafted at
    once by their class (`Proposer.draft_together`)."""
    return type(jobs[0][0]).draft_together(jobs, clock) if jobs else []


class ProposerFailed(RuntimeError):
    """Raised by a proposer that cannot serve any more (dead peer): the loop goes on without it."""


class Proposer(ABC):
    """A cheap source of draft tokens for one sequence."""

    name: str = "proposer"
    # Declared capabilities (what the loops and agents may ask of a proposer):
    drafts_trees: bool = False  # propose() may return a tree (Draft.parents); k = node budget
    wants_features: bool = False  # drafts from the verifier's hidden states (flow F3)
    fallback_tokens: int = 0  # positions whose features it had to compute itself
    # drafts arrive on their own schedule (a draft-model agent drafting ahead on another
    # machine) and the proposer itself decides how long a block waits for them
    # (controller.tokens_to_wait): that wait is not a per-token drafting cost, so the block
    # length is chosen as if drafts were free and the proposer cuts it to what is there
    paced: bool = False
    # the store (engine/batch_kv.py's BatchKV) its cache is a row of, shared with other
    # sessions' drafters of the same model (`share_rows`): then `draft_together` drafts all of
    # them at once; None: it drafts alone
    rows = None

    def share_rows(self, stores: dict) -> None:
        """Serving one of many sessions: keep its cache as a row of the store `stores` holds
        for its model (made there on first use), so its chains are drafted with the other
        sessions' (`draft_together`). A drafter that cannot leaves itself as it is."""

    @staticmethod
    def draft_together(jobs: Sequence[tuple[Proposer, Sequence[int], int]],
                       clock: Callable[[], float] = time.perf_counter) -> list[Draft]:
        """Every job's chain (proposer, context, k), the proposers' caches rows of one store:
        at once where the drafter's class can (one forward per draft position for all),
        here one after the other. clock (seconds): what the drafts' `draft_ms` and `step_ms`
        are measured with (a batching engine's own clock)."""
        return [p.propose(ctx, k) for p, ctx, k in jobs]

    def feed_features(self, start: int, tokens: Sequence[int], hidden) -> None:
        """Hidden states of committed positions start.. (flow F3); only for wants_features."""
        raise TypeError(f"{self.name} does not draft from hidden states")

    def untap(self) -> None:
        """Before `start`: the features will all come through `feed_features` (a batched
        forward runs no tap on the model); only for wants_features."""


    def start(self, params: SamplingParams) -> None:
        """Begin a new sequence with these sampling parameters (drops all cached state)."""
        self.params = params

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k draft tokens continuing `context` (the full committed sequence)."""

    def draft_length(self) -> int | None:
        """The draft length this drafter asks for itself in a token tree (None: its group's
        controller sizes it); a drafter that knows when it is right (a request's prediction)
        may ask for long drafts."""
        return None

    def begin(self, context: Sequence[int], k: int) -> None:
        """Start drafting for `propose(context, k)`; `finish()` returns the draft. A batching
        verifier begins every session's draft before finishing any, so drafters on other
        machines draft at the same time; a local drafter just drafts in `finish`."""
        self._begun = (context, k)

    def finish(self) -> Draft:
        """The draft `begin` asked for."""
        context, k = self._begun
        return self.propose(context, k)

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        """What became of the last draft: its tokens, how many were accepted, and the verify
        time of the block, which held `verified` tokens (default drafted + 1; more when
        several drafters shared the block's tree)."""

    def seed_verify_costs(self, costs: Mapping[int, float]) -> None:
        """The verifier's measured verify(L) in ms by length (engine/verify_costs.py), for
        drafters that size their trees against it; others ignore it."""

    def close(self) -> None:
        """Release caches; the proposer may be started again."""
