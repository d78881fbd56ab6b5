"""Drafting one block ahead: the one shape every drafter that drafts ahead uses.

While the verifier verifies a block, a drafter that need not wait for it (a host-side lookup in
one process, a proposer agent on another machine) drafts the next block from the outcome it
expects: the block's branch accepted, then a bonus token it cannot know yet. So it drafts one
token early, from the context + the branch, and its draft's top-level nodes are its guesses of
that bonus token; when the verifier commits the branch and a bonus one of them guessed, the
subtree under that guess is the next block's draft, ready before it is asked for
(`tree.reroot`; a chain is the tree i -> i - 1). Anything else, and the draft is dropped.

User: a proposer agent's tree sessions (agents/draft_stream.py). A draft-model agent (agents/
draft_service.py) keeps a longer stream instead, by the rule of `agents.draft_stream.survives`.
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
    the block went as it expected (its branch committed, its guess among the top level);
    None otherwise (draft afresh)."""
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
