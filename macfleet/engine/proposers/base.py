"""The proposer interface: every call gets the whole committed context, so a proposer's cache
is its own business and a remote one recovers from any mismatch by itself (docs/drafters.md,
"base.py")."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from macfleet.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Draft tokens and, when the proposer sampled them, the distributions they came from."""

    tokens: tuple[int, ...]
    probs: np.ndarray | None = field(default=None, compare=False)  # [len(tokens), V]
    draft_ms: float = 0.0
    # a token tree: parents[i] indexes token i's parent (-1: the last committed token), parents
    # first
    parents: tuple[int, ...] | None = None
    # drafted with other sessions' chains (`draft_together`): one draft position after the
    # first, for all of them; None: not measured
    step_ms: float | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(tokens=())


def _int_prefix(xs: Sequence, ok: Callable[[int, int], bool]) -> list[int]:
    """The longest prefix of `xs` whose items are integers x with ok(index, x)."""
    out: list[int] = []
    for i, x in enumerate(xs):
        if not isinstance(x, (int, np.integer)) or not ok(i, int(x)):
            break
        out.append(int(x))
    return out


def sanitize_draft(draft: Draft, k: int, vocab: int) -> Draft:
    """The longest prefix of a draft (a tree's: of nodes) whose tokens and parents are valid;
    probabilities that are not a [n, V] pmf dropped."""
    toks = _int_prefix(draft.tokens[:k], lambda i, t: 0 <= t < vocab)
    parents = None
    if draft.parents is not None:  # each parent before its child
        parents = tuple(_int_prefix(list(draft.parents)[: len(toks)], lambda i, p: -1 <= p < i))
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
    """Chains of drafters whose caches are rows of one store, drafted by their class."""
    return type(jobs[0][0]).draft_together(jobs, clock) if jobs else []


def draft_in_rows(jobs: Sequence[tuple[Proposer, Sequence[int], int]],
                  clock: Callable[[], float], min_context: int, refusal: str,
                  roots: Callable, logits: Callable, advance: Callable,
                  lazy_roots: bool = False) -> list[Draft]:
    """Every job's (proposer, context, k) chain at once, the caches rows of one store (else
    ValueError(refusal)): one batched forward per draft position for all (docs/drafters.md,
    "Drafting together"); EMPTY_DRAFT for k <= 0 or a context under `min_context`. Over the
    drafting proposers `ps`: roots(ps, contexts) -> (each one's state after its context; the
    ids of the logits' columns, None: the vocabulary's), logits(ps, states) -> [n, V] and
    advance(ps, states, tokens) -> the next states. lazy_roots: the first read evaluates the
    roots, and is timed with them."""
    t0 = clock()
    out = [EMPTY_DRAFT] * len(jobs)
    live = [(i, p, k) for i, (p, ctx, k) in enumerate(jobs) if k > 0 and len(ctx) >= min_context]
    if not live:
        return out
    store = live[0][1].rows
    if any(p.rows is None or p.rows is not store for _, p, _ in live):
        raise ValueError(refusal)
    ps, ks = [p for _, p, _ in live], [k for *_, k in live]
    states, ids = roots(ps, [jobs[i][1] for i, _, _ in live])
    t1 = None if lazy_roots else clock()
    tokens: list[list[int]] = [[] for _ in live]
    rows: list[list[np.ndarray]] = [[] for _ in live]
    for step in range(max(ks)):
        act = [j for j, k in enumerate(ks) if step < k]
        lg = logits([ps[j] for j in act], [states[j] for j in act])
        if all(ps[j].params.greedy for j in act):  # one read of every argmax
            for j, b in zip(act, np.array(mx.argmax(lg, axis=-1)).tolist()):
                tokens[j].append(int(b) if ids is None else int(ids[b]))
        else:
            for r, j in enumerate(act):
                tokens[j].append(ps[j]._pick(lg[r], rows[j]))
        if t1 is None:  # the first position read: the pairs committed since the last draft ran
            t1 = clock()
        more = [j for j in act if step + 1 < ks[j]]
        if not more:
            break
        new = advance([ps[j] for j in more], [states[j] for j in more],
                      [tokens[j][-1] for j in more])
        for j, s in zip(more, new):
            states[j] = s
    mx.eval(store.state)  # the rows' last writes (a forward that evaluates them: nothing left)
    t2, steps = clock(), max(ks) - 1
    ms, step = (t2 - t0) * 1e3 / len(live), (t2 - t1) * 1e3 / steps if steps else None
    for j, (i, _, _) in enumerate(live):
        out[i] = Draft(tuple(tokens[j]), np.stack(rows[j]) if rows[j] else None, ms,
                       step_ms=step)
    return out


class ProposerFailed(RuntimeError):
    """Raised by a proposer that cannot serve any more (dead peer): the loop goes on without it."""


class Proposer(ABC):
    """A cheap source of draft tokens for one sequence."""

    name: str = "proposer"
    # Declared capabilities (what the loops and agents may ask of a proposer):
    drafts_trees: bool = False  # propose() may return a tree (Draft.parents); k = node budget
    wants_features: bool = False  # drafts from the verifier's hidden states (flow F3)
    fallback_tokens: int = 0  # positions whose features it had to compute itself
    # drafts arrive on their own schedule and the proposer decides how long a block waits
    # (a draft-model agent): the block length is chosen as if drafts were free
    paced: bool = False
    rows = None  # the BatchKV its cache is a row of (`share_rows`); None: it drafts alone

    def share_rows(self, stores: dict) -> None:
        """Keep its cache as a row of its model's store in `stores`, to be drafted together;
        a no-op where it cannot."""

    @staticmethod
    def draft_together(jobs: Sequence[tuple[Proposer, Sequence[int], int]],
                       clock: Callable[[], float] = time.perf_counter) -> list[Draft]:
        """Every job's (proposer, context, k) chain, at once where the class can; here one after
        the other. clock: what `draft_ms` and `step_ms` are measured with."""
        return [p.propose(ctx, k) for p, ctx, k in jobs]

    def feed_features(self, start: int, tokens: Sequence[int], hidden) -> None:
        """Hidden states of committed positions start.. (flow F3); only for wants_features."""
        raise TypeError(f"{self.name} does not draft from hidden states")

    def untap(self) -> None:
        """Before `start`: every feature will come through `feed_features`."""

    def start(self, params: SamplingParams) -> None:
        """Begin a new sequence with these sampling parameters (drops all cached state)."""
        self.params = params

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k draft tokens continuing `context` (the full committed sequence)."""

    def begin(self, context: Sequence[int], k: int) -> None:
        """Start drafting for `propose(context, k)`; `finish()` returns the draft."""
        self._begun = (context, k)

    def finish(self) -> Draft:
        """The draft `begin` asked for."""
        context, k = self._begun
        return self.propose(context, k)

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        """What became of the last draft: how many were accepted, and the verify time of the
        block of `verified` tokens (default drafted + 1)."""

    def seed_verify_costs(self, costs: Mapping[int, float]) -> None:
        """The verifier's measured verify(L) in ms by length (engine/verify_costs.py)."""

    def close(self) -> None:
        """Release caches; the proposer may be started again."""
