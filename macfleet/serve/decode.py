"""Each session's share of an iteration's forward: verified rows -> accept -> commit, with
the single-session loops' rules (engine/block.py), for a chain block and a token tree. Every
decision, cache buffer, drafter feature, SpecInfer probability and requested logprob is read
in ONE evaluation (`read_iteration`). A session's committed tokens and `SessionStats` are
written here only. docs/serving.md, "decode.py".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from macfleet.engine.batch import RowCache, Segment, trim_cache
from macfleet.engine.block import chain_outcome, commit_block, tree_decided, tree_decision
from macfleet.engine.constraint import masked_logits, masked_tree_logits
from macfleet.engine.events import BlockDone, TokensCommitted
from macfleet.engine.sampling import host_probs, softmax_probs
from macfleet.engine.proposers.base import Draft
from macfleet.engine.tree import TokenTree, accept_tree_sample
from macfleet.engine.tree_verify import keep_path
from macfleet.engine.verifier import Verifier
from macfleet.serve.batch_session import BatchSession
from macfleet.serve.costs import BatchCosts
from macfleet.serve.logprobs import (LogprobsCommitted, RowLogprobs, TokenLogprob, chain_rows,
                                      row_logprobs, tree_rows)
from macfleet.serve.prompt_cache import PromptReused
from macfleet.serve.scheduler import Slot

Finish = Callable[[BatchSession, str], None]  # (session, finish reason: stop | length)


@dataclass(frozen=True)
class IterationRead:
    """What the host reads of one iteration's forward, evaluated at once: each session's
    `decision` as integers; probabilities of trees left to SpecInfer's host rule; requested
    logprobs rows; per store, its trees' nodes' keys and values (`BatchKV.fetch`)."""

    decided: dict[int, list[int]]
    probs: dict[int, mx.array]
    logprobs: dict[int, RowLogprobs]
    fetched: dict = field(default_factory=dict)


class BlockStep:
    """costs: told each drafted block's outcome (the pool of acceptance); finish: ends a
    session whose block hit a stop token or its length."""

    def __init__(self, clock: Callable[[], float], costs: BatchCosts, finish: Finish) -> None:
        self.clock, self.costs, self.finish = clock, costs, finish

    def verified(self, run: Sequence[tuple[BatchSession, Slot]], segs: Sequence[Segment],
                 hidden: Sequence[mx.array] | None, verify_ms: float,
                 read: IterationRead) -> None:
        """One forward's results, read (`read_iteration`): prefill chunks counted, every block
        accepted and committed."""
        # accept: trees first, so every row keeps its path before anything is committed
        accepted = self.accept_trees([s for s, sl in run
                                      if not sl.prefill and s.block.tree is not None], read)
        if hidden is not None:
            feed(run, segs, hidden, accepted)
        # commit, session by session
        for s, slot in run:
            if slot.prefill:
                s.kv_handle.advance(slot.tokens, self.clock())
            elif s.block.tree is not None:
                self.commit_tree(s, *accepted[s.sid], verify_ms, read.logprobs.get(s.sid),
                                 forward=sum(sl.tokens for _, sl in run))
            else:
                self.commit_chain(s, verify_ms, tuple(read.decided[s.sid]),
                                  read.logprobs.get(s.sid))

    @staticmethod
    def accept_trees(done: Sequence[BatchSession], read: IterationRead
                     ) -> dict[int, tuple[list[int], int]]:
        """Each verified tree's accepted path and next token, from its decision or by
        SpecInfer's host rule; every row then keeps its root and path before anything is
        committed, so a session that ends here leaves a consistent row."""
        out, kept = {}, {}
        for s in done:
            tree = s.block.tree
            if s.sid in read.decided:
                path, nxt = out[s.sid] = tree_decided(tree, s.req.params, read.decided[s.sid])
            else:
                path, nxt = out[s.sid] = accept_tree_sample(
                    tree, host_probs(read.probs[s.sid], s.req.params), s.rng)
            if isinstance(s.cache, Verifier):  # its own forward's (batch-invariant)
                keep_path(s.cache, tree, path)
                continue
            base = s.cache.offset - len(tree.tokens)
            kept.setdefault(s.cache.store, []).append((s.cache, base, path))
        for store, rows in kept.items():
            store.keep_paths(rows, read.fetched.get(store))
        return out

    def commit_tree(self, s: BatchSession, path: list[int], nxt: int, verify_ms: float,
                    rows: RowLogprobs | None = None, *, forward: int = 0) -> None:
        """rows: the block's logprobs, evaluated (None: not asked); forward: the tokens of the
        forward `verify_ms` timed (0: this tree's)."""
        tree, predicted = s.block.tree, s.block.predicted
        new = [*tree.path_tokens(path), nxt]
        lps = _logprobs(tree_rows(path, len(new)), new, rows)
        # the session's own drafters' nodes and trials (a prediction's misses are not theirs)
        theirs = set().union(*tree.owned[:-1]) if predicted else None
        trials, hits = tree_trials(tree, path, theirs)
        if trials:
            self._trials(s, trials, hits)
        drafts, accepted = verified_drafts(s.block.drafts, tree), tree.accepted_per_source(path)
        verified, theirs_ms = len(tree.tokens), verify_ms
        if predicted:  # the prediction's draft is the last: the others learn of theirs,
            # and of the time their nodes alone would have taken (the batch's cost curve)
            (d, n), drafts, accepted = (drafts[-1], accepted[-1]), drafts[:-1], accepted[:-1]
            s.prediction.observe(len(d), n, verify_ms, verified)
            s.stats.prediction_drafted += len(d)
            s.stats.prediction_accepted += n
            mine = 1 + len(theirs)  # root + their nodes
            theirs_ms = self.costs.without(verify_ms, max(forward, verified), verified - mine)
            verified = mine
        if s.group is not None:
            s.group.observe(drafts, accepted, theirs_ms, verified)
        else:  # a chain drafter's block, with the prediction beside it
            self._chain_observed(s, drafts[0], accepted[0], theirs_ms)
        self.commit(s, new, drafted=tree.size, accepted=len(path), verify_ms=verify_ms,
                    logprobs=lps)

    def commit_chain(self, s: BatchSession, verify_ms: float, outcome: tuple[int, int],
                     rows: RowLogprobs | None = None) -> None:
        """outcome: the block's (accepted, next token), its `decision`; rows: as
        `commit_tree`'s."""
        d = s.block.draft
        n, nxt = outcome
        new = [*d.tokens[:n], nxt]
        lps = _logprobs(chain_rows(len(new)), new, rows)
        if len(d) - n:
            trim_cache(s.cache, len(d) - n)
        if len(d):
            self._trials(s, n + (n < len(d)), n)
        self._chain_observed(s, d, n, verify_ms)
        self.commit(s, new, drafted=len(d), accepted=n, verify_ms=verify_ms, logprobs=lps)

    @staticmethod
    def _chain_observed(s: BatchSession, d: Draft, n: int, verify_ms: float) -> None:
        """A chain drafter's draft `d` and its `n` tokens accepted: it and its controller
        learn (the controller of every block, drafted or not)."""
        if len(d) and s.proposer is not None:
            s.proposer.observe(len(d), n, verify_ms)
        # a paced drafter's wait is its own decision, not a per-token drafting cost
        s.controller.observe(len(d), n, 0.0 if s.proposer is not None and s.proposer.paced
                             else s.block.draft_ms, verify_ms)

    def _trials(self, s: BatchSession, trials: int, accepted: int) -> None:
        s.stats.trials += trials
        s.stats.hits += accepted
        self.costs.observe_block(trials, accepted)

    def commit(self, s: BatchSession, new: list[int], *, drafted: int, accepted: int,
               verify_ms: float, logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        """A verified block's committed tokens (cut at a stop token) into the session's
        context and out to the client, once each; the session finished at a stop token or its
        length."""
        new, stopped = commit_block(new, s.req.eos_ids, s.constraint)
        s.context.extend(new)
        s.generated.extend(new)
        b, h = s.block, s.kv_handle
        s.stats.tally.record(drafted, accepted, b.draft_ms, verify_ms)
        blocks = s.stats.tally.blocks
        if blocks == 1 and (h.cached or h.shared):
            s.emit(PromptReused(h.cached + h.shared))
        if s.req.report_blocks:
            choice = getattr(s.group, "choice", None)  # `auto`'s candidate for this block
            s.emit(BlockDone(block=blocks, k=b.k, drafted=drafted, accepted=accepted,
                             committed=len(new), draft_ms=b.draft_ms, verify_ms=verify_ms,
                             block_ms=b.draft_ms + verify_ms,
                             drafter=choice.drafter if choice else "",
                             why=choice.why if choice else ""))
        if new:
            s.stats.times.commit(self.clock())
            if logprobs:
                s.emit(LogprobsCommitted(logprobs[:len(new)]))
            s.emit(TokensCommitted(blocks, tuple(new)))
        if stopped:
            self.finish(s, "stop")
        elif len(s.generated) >= s.req.max_tokens:
            self.finish(s, "length")


def tree_trials(tree: TokenTree, path: Sequence[int], nodes: set[int] | None = None
                ) -> tuple[int, int]:
    """A tree block's geometric trials and successes (pure): its accepted path, and one
    trial more where the tree had more to offer below it; `nodes`: only these count (the
    session's own drafters', beside a prediction's; on the path they are a prefix of it)."""
    if nodes is not None:
        path = [i for i in path if i in nodes]
    last = path[-1] if path else 0
    more = any(nodes is None or c in nodes for c in tree.children[last].values())
    return len(path) + more, len(path)


def verified_drafts(drafts: Sequence[Draft], tree: TokenTree) -> list[Draft]:
    """The drafts as far as the verified tree held them (the scheduler or a grammar may have
    cut it), so each drafter's counts are of tokens verified, not of tokens drafted."""
    if len(tree.owned) != len(drafts):
        return list(drafts)
    return [d if len(d) <= len(own) else replace(d, tokens=d.tokens[:len(own)], probs=None)
            for d, own in zip(drafts, tree.owned)]


def decision(s: BatchSession, logits: mx.array, ahead: int = 0) -> mx.array | None:
    """A decoding session's block decision, lazy, on its grammar-masked rows: a chain's
    (accepted, next token) (`block.chain_outcome`), a tree's `block.tree_decision`; None for
    a tree whose drafts carry probabilities (SpecInfer's host rule). ahead: the block's first
    output position is this far past the committed tokens (a step dispatched ahead)."""
    params, start, b = s.req.params, len(s.generated) + ahead, s.block
    if b.tree is not None:
        return tree_decision(b.tree, masked_tree_logits(s.constraint, logits, b.tree),
                             params, s.seed, start)
    return chain_outcome(b.draft, masked_logits(s.constraint, logits, b.draft.tokens),
                         params, s.seed, start)


def decisions(run: Sequence[tuple[BatchSession, Slot]], out: Sequence[mx.array | None],
              ahead: int = 0) -> dict[int, mx.array]:
    """Every decoding session's `decision` on a forward's lazy logits `out`, lazy (a tree
    left to SpecInfer's host rule has none); ahead: as `decision`'s."""
    lazy = {}
    for (s, sl), lg in zip(run, out):
        if not sl.prefill and (d := decision(s, lg, ahead)) is not None:
            lazy[s.sid] = d
    return lazy


def logprob_rows(run: Sequence[tuple[BatchSession, Slot]], out: Sequence[mx.array | None]
                 ) -> dict[int, RowLogprobs]:
    """The logprobs rows (lazy) of every decoding block whose request asked, built with the
    decisions, before anything is dispatched behind the forward (`to_host`)."""
    return {s.sid: row_logprobs(lg, s.req.logprobs) for (s, sl), lg in zip(run, out)
            if not sl.prefill and s.req.logprobs is not None}


def read_iteration(run: Sequence[tuple[BatchSession, Slot]], out: Sequence[mx.array | None],
                   also: Sequence[mx.array] = (), decided: dict[int, mx.array] | None = None,
                   logprobs: dict[int, RowLogprobs] | None = None) -> IterationRead:
    """Everything the host reads of a forward (`IterationRead`), evaluated with `also` (the
    forward's cache buffers and hidden features) in ONE `mx.eval`; decided, logprobs: built
    already, lazy (`decisions`, `logprob_rows`)."""
    lazy = decisions(run, out) if decided is None else decided
    lps = logprob_rows(run, out) if logprobs is None else logprobs
    probs, spans = {}, {}
    for (s, sl), lg in zip(run, out):
        if sl.prefill:
            continue
        tree = s.block.tree
        if tree is not None and len(tree.tokens) > 1 and isinstance(s.cache, RowCache):
            n = len(tree.tokens)  # its drafted nodes, past the root: what a path moves
            spans.setdefault(s.cache.store, []).append((s.cache, s.cache.offset - n + 1, n - 1))
        if s.sid not in lazy:  # a tree whose drafts carry probabilities: SpecInfer's host rule
            probs[s.sid] = softmax_probs(lg, s.req.params)
    fetched = {store: store.fetch(sp) for store, sp in spans.items()}
    extra = [*probs.values(), *(a for r in lps.values() for a in r.arrays()),
             *(a for f in fetched.values() for a in f.arrays()), *also]
    return IterationRead(to_host(lazy, extra), probs, lps, fetched)


def to_host(lazy: dict[int, mx.array], also: Sequence[mx.array] = ()
            ) -> dict[int, list[int]]:
    """Lazy integer vectors -> their values, in ONE evaluation with `also`. No op is built on
    them here: it would queue behind the step dispatched ahead and wait for it too."""
    mx.eval(list(lazy.values()), list(also))
    return {sid: a.tolist() for sid, a in lazy.items()}


def feed(run: Sequence[tuple[BatchSession, Slot]], segs: Sequence[Segment],
         hidden: Sequence[mx.array], accepted: dict[int, tuple[list[int], int]]) -> None:
    """Hidden-state drafters get their session's rows of the forward as a single-session tap
    would: at their positions, a tree's root and accepted path moved as its cache was."""
    for (s, slot), seg, h in zip(run, segs, hidden):
        if not s.feeds:
            continue
        start = seg.cache.offset - len(seg)  # the offset before this forward
        toks = seg.tokens
        tree = s.block.tree
        if not slot.prefill and tree is not None:
            path = accepted[s.sid][0]
            start = s.cache.offset - 1 - len(path)  # kept: root + path
            toks = (tree.tokens[0], *tree.path_tokens(path))
            h = h[mx.array([0, *path], dtype=mx.int32)]
        for p in s.feeds:
            p.feed_features(start, toks, h)


def _logprobs(rows: list[int], new: list[int], evaluated: RowLogprobs | None
              ) -> tuple[TokenLogprob, ...] | None:
    """The committed tokens' logprobs from the block's evaluated rows (None: not asked; the
    batch reads every block's whose request asked: `logprob_rows`)."""
    return None if evaluated is None else evaluated.entries(rows, new)
