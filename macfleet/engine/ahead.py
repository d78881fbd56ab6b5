"""Drafting one block ahead: the one shape every drafter that drafts ahead uses.

While the verifier verifies a block, a drafter that need not wait drafts the next one from the
outcome it expects, one token early: its draft's top-level nodes guess the bonus token, and
when the verifier commits the branch and a guessed bonus, the subtree under that guess is the
next block's draft (`tree.reroot`); anything else drops it. User: agents/draft_stream.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from macfleet.engine.proposers.base import Draft, ProposerFailed
from macfleet.engine.tree import reroot


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
