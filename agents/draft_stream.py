"""One drafting session on a proposer agent: the committed context plus a speculative stream.

The stream holds draft tokens beyond the committed context (with their distributions when
sampling). A request's committed tokens either are a prefix of it, and the rest answers at once
(cross-round drafting), or refute it, and drafting restarts from the new context; reusing
stream tokens is lossless for sampling too (docs/agents.md, "draft_stream.py").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from macfleet.engine.proposers.base import Draft, Proposer, ProposerFailed
from macfleet.engine.tree import longest_branch, reroot


def survives(stream: Sequence[int], committed: Sequence[int]) -> bool:
    """Whether a draft stream outlives a commit: every stream token at a committed position is
    the committed token. The one rule both ends of a draft-ahead session apply, so they agree on
    which drafts are current without a round trip."""
    return all(int(a) == int(b) for a, b in zip(stream, committed))


# -- drafting one block ahead: the one shape every drafter that drafts ahead uses -----------
# While the verifier verifies a block, a drafter that need not wait drafts the next one from the
# outcome it expects, one token early: its draft's top-level nodes guess the bonus token, and
# when the verifier commits the branch and a guessed bonus, the subtree under that guess is the
# next block's draft (`tree.reroot`); anything else drops it.
@dataclass(frozen=True)
class Ahead:
    """A draft made one token early, from the committed context + `branch`."""

    context_len: int  # the committed length the expected outcome gives (+ branch + bonus)
    branch: tuple[int, ...]  # the tokens it expects committed before the bonus
    draft: Draft  # drafted from context + branch: its top-level nodes guess the bonus


def draft_ahead(propose: Callable[[list[int], int], Draft], context: Sequence[int],
                branch: Sequence[int], k: int) -> Ahead | None:
    """Draft k tokens past `context + branch + bonus` (k + 1 from context + branch: the first
    level guesses the bonus); None when the drafter fails or has nothing."""
    base = [*context, *branch]
    try:
        d = propose(base, k + 1)
    except ProposerFailed:
        return None  # the next fresh draft reports it
    if not d.tokens:
        return None
    return Ahead(len(base) + 1, tuple(int(t) for t in branch), d)


def take(ahead: Ahead | None, context: Sequence[int], k: int | None = None) -> Draft | None:
    """The draft made ahead, re-rooted at the committed bonus token and cut to k nodes, when
    the block went as it expected; None otherwise (draft afresh)."""
    if ahead is None or len(context) != ahead.context_len:
        return None
    n = len(ahead.branch)
    if tuple(int(t) for t in context[len(context) - 1 - n: len(context) - 1]) != ahead.branch:
        return None  # another branch of the same length
    d = ahead.draft
    toks, par, idx = reroot(d.tokens, d.parents, int(context[-1]))
    if not toks:
        return None
    k = len(toks) if k is None else k
    probs = d.probs[idx[:k]] if d.probs is not None else None
    parents = tuple(par[:k]) if d.parents is not None else None
    return Draft(tuple(toks[:k]), probs, 0.0, parents)


MIN_LOOKAHEAD_HIT_RATE = 0.2
LOOKAHEAD_RETRY = 8  # with a low hit rate, still pre-draft before every 8th request


@dataclass
class StreamReply:
    tokens: list[int]
    probs: np.ndarray | None
    predraft_hit: bool  # the pre-drafted stream survived and supplied at least one token


@dataclass
class DraftStream:
    proposer: Proposer
    context: list[int]
    want_probs: bool
    cross_round: bool
    stream: list[int] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    last_k: int = 4
    last_used: float = field(default_factory=time.monotonic)
    exhausted: bool = False  # the proposer had nothing more to say for this stream
    # how often a request was answered from the pre-drafted stream (EMA): lookahead pauses
    # while hits are rare (docs/agents.md, "draft_stream.py")
    hit_rate: float = 0.5
    requests: int = 0
    last_drafted: int = 0  # tokens of the last tree drafted (what the verifier reports on)
    _survived: bool = False
    # a tree drafter's next tree, drafted early from the outcome it expects (`Ahead` above)
    last_tree: Draft | None = None
    tree_ahead: Ahead | None = None

    def replied_tree(self, d: Draft) -> None:
        """The tree just sent for the current context: the next one may be drafted early."""
        self.last_tree, self.tree_ahead = (d if d.tokens else None), None
        self.last_used = time.monotonic()

    def predraft_tree(self) -> bool:
        """Draft the next tree from the outcome the last one expects; False: nothing to do."""
        d, self.last_tree = self.last_tree, None
        if d is None:
            return False
        parents = d.parents if d.parents is not None else tuple(range(-1, len(d.tokens) - 1))
        branch = [int(d.tokens[i]) for i in longest_branch(parents)]
        self.tree_ahead = draft_ahead(self.proposer.propose, self.context, branch, self.last_k)
        return True

    def take_tree(self, k: int) -> Draft | None:
        """The tree drafted early, re-rooted at the committed bonus token and cut to k nodes,
        when the verifier accepted the branch it assumed; None: draft afresh."""
        ahead, self.tree_ahead = self.tree_ahead, None
        self.requests += 1
        hit = take(ahead, self.context, k)
        if hit is not None:  # a tree, even where the drafter's own draft was a chain
            hit = Draft(hit.tokens, None, 0.0,
                        hit.parents or tuple(range(-1, len(hit.tokens) - 1)))
        self.hit_rate = 0.8 * self.hit_rate + 0.2 * float(hit is not None)
        return hit

    def commit(self, committed: Sequence[int]) -> bool:
        """Append the verifier's committed tokens; returns whether the stream survived them
        (`survives`): what is left of it continues the new context, else it is dropped."""
        committed = [int(t) for t in committed]
        self.context.extend(committed)
        self._survived = survives(self.stream, committed)
        n = len(committed) if self._survived else None  # (None: all of it)
        del self.stream[:n]
        del self.rows[:n]
        if not self.stream:  # the context grew past the stream: a lookup may find more
            self.exhausted = False
        return self._survived

    def extend(self, n: int = 1) -> int:
        """Draft up to n more stream tokens; returns how many were added."""
        if self.exhausted:
            return 0
        return self.take(self.proposer.propose(self.context + self.stream, n))

    def take(self, d: Draft) -> int:
        """Append a draft of the stream's next tokens (drafted from context + stream); returns
        how many were added."""
        if not d.tokens:
            self.exhausted = True
            return 0
        self.stream.extend(d.tokens)
        if d.probs is not None:
            self.rows.extend(d.probs)
        return len(d.tokens)

    def draft(self, k: int) -> StreamReply:
        """The next k tokens of the stream, drafting what is missing now."""
        self.last_k = k
        self.last_used = time.monotonic()
        hit = bool(self.stream) and k > 0 and self._survived
        self.requests += 1
        self.hit_rate = 0.8 * self.hit_rate + 0.2 * float(hit)
        while len(self.stream) < k and self.extend(k - len(self.stream)):
            pass
        toks = self.stream[:k]
        probs = None  # without distributions (n-gram): exact-match acceptance
        if self.want_probs and toks and len(self.rows) >= len(toks):
            probs = np.stack(self.rows[: len(toks)]).astype(np.float32)
        return StreamReply(toks, probs, hit)

    def wants_lookahead(self) -> bool:
        """Cross-round: keep one block + the bonus guess + the next block pre-drafted (a
        tree drafter: the next tree, once)."""
        if self.proposer.drafts_trees:
            if not self.cross_round or self.last_tree is None:
                return False
        elif not self.cross_round or self.exhausted or len(self.stream) >= 2 * self.last_k + 1:
            return False
        return self.hit_rate >= MIN_LOOKAHEAD_HIT_RATE or self.requests % LOOKAHEAD_RETRY == 0
