"""Each session's verified block -> accept -> commit (serve/decode.py), on given logits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from engine_parts_kit import Scripted, session

from macfleet.engine.events import BlockDone, TokensCommitted
from macfleet.engine.proposers.base import Draft
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.tree import TokenTree
from macfleet.serve.costs import BatchCosts
from macfleet.serve.decode import BlockStep
from macfleet.serve.logprobs import LogprobsCommitted
from macfleet.serve.prompt_cache import PromptReused
from macfleet.serve.scheduler import Slot

V = 8


def _logits(argmax: list[int]) -> mx.array:
    a = np.full((len(argmax), V), -5.0, np.float32)
    a[np.arange(len(argmax)), argmax] = 5.0
    return mx.array(a)


class Layer:
    def __init__(self, offset: int) -> None:
        self.offset = offset

    def trim(self, n: int) -> None:
        self.offset -= n


def _step():
    ended = []
    costs = BatchCosts(None, 1.5, probe=lambda m: {})
    return BlockStep(lambda: 1.0, costs, lambda s, why: ended.append((s.sid, why))), ended


def _chain(draft=(3, 4, 5), **kw):
    s = session(proposer=Scripted(), **kw)
    s.cache = [Layer(10), Layer(10)]  # the prompt and the block [root, drafts] in it
    s.draft, s.k, s.draft_ms = Draft(draft), len(draft), 2.0
    return s


def test_a_chain_commits_its_accepted_drafts_and_the_next_token_and_rolls_back_the_rest():
    step, ended = _step()
    s = _chain()
    step.commit_chain(s, _logits([3, 4, 7, 1]), 9.0)
    assert s.generated == [3, 4, 7] and s.context[-3:] == [3, 4, 7]
    assert [c.offset for c in s.cache] == [9, 9]  # the rejected draft's entry dropped
    assert s.events == [TokensCommitted(1, (3, 4, 7))]
    assert s.proposer.observed == [(3, 2)] and s.trials == 3
    assert step.costs.pool_totals() == (3, 2)
    assert (s.tally.blocks, s.tally.drafted, s.tally.accepted) == (1, 3, 2) and not ended


def test_the_outcome_given_decides():
    step, _ = _step()
    s = _chain()
    step.commit_chain(s, _logits([3, 4, 7, 1]), 9.0, outcome=(3, 6))
    assert s.generated == [3, 4, 5, 6]


def test_a_stop_token_cuts_the_block_and_ends_the_session():
    step, ended = _step()
    s = _chain(eos=frozenset({4}))
    step.commit_chain(s, _logits([3, 4, 7, 1]), 9.0)
    assert s.generated == [3] and s.events[-1] == TokensCommitted(1, (3,))
    assert ended == [(0, "stop")]


def test_the_length_ends_the_session():
    step, ended = _step()
    s = _chain(max_tokens=3)
    step.commit_chain(s, _logits([3, 4, 7, 1]), 9.0)
    assert ended == [(0, "length")]


def test_what_a_request_asked_for_comes_before_its_tokens():
    step, _ = _step()
    s = _chain(cached=5)
    s.req = s.req.__class__(**{**s.req.__dict__, "report_blocks": True, "logprobs": 1})
    step.commit_chain(s, _logits([3, 4, 7, 1]), 9.0)
    kinds = [type(e) for e in s.events]
    assert kinds == [PromptReused, BlockDone, LogprobsCommitted, TokensCommitted]
    done = s.events[1]
    assert (done.k, done.drafted, done.accepted, done.committed) == (3, 3, 2, 3)
    assert len(s.events[2].entries) == 3


class Store:
    def __init__(self) -> None:
        self.kept = []

    def keep_paths(self, rows) -> None:
        self.kept.extend(rows)
        for c, base, path in rows:
            c.offset = base + 1 + len(path)


class Row:
    def __init__(self, store: Store, offset: int) -> None:
        self.store, self.offset = store, offset


def test_verified_counts_prefill_chunks_and_commits_chains_and_trees():
    step, _ = _step()
    store = Store()
    pre = session(1, prompt=(1, 2, 3, 4), t_start=0.0)
    chain = _chain()
    tree_s = session(2, proposer=None)
    tree_s.tree = TokenTree.from_drafts(3, [(4,), (6, 5)], [None, None], [None, None])
    tree_s.cache = Row(store, 10 + 4)  # the tree's 4 nodes after 10 committed positions
    tree_s.group = type("G", (), {"observe": lambda *a: None})()
    run = [(pre, Slot(1, 2, True)), (chain, Slot(0, 4, False)), (tree_s, Slot(2, 4, False))]
    out = [None, _logits([3, 4, 7, 1]), _logits([6, 1, 5, 2])]
    step.verified(run, [None] * 3, out, None, 9.0)
    assert pre.prefilled == 2 and pre.prefill_left == 1 and pre.prefill_ms == 0.0
    assert chain.generated == [3, 4, 7]
    assert tree_s.generated == [6, 5, 2]
    assert store.kept == [(tree_s.cache, 10, [2, 3])] and tree_s.cache.offset == 13
    step.verified([(pre, Slot(1, 1, True))], [None], [None], None, 9.0)
    assert pre.prefill_left == 0 and pre.prefill_ms == 1e3  # clock 1.0 s after t_start


def _mixed_batch():
    """Greedy and sampled chains and trees (drafts without probabilities), one store: the
    run, its logits, and the sessions."""
    rng = np.random.default_rng(5)
    store = Store()
    run, out = [], []
    for i in range(6):
        params = GREEDY if i % 2 == 0 else SamplingParams(0.9, seed=40 + i)
        if i < 4:
            s = _chain(draft=(3, 4, 5), sid=i, params=params)
        else:
            s = session(i, proposer=None, params=params)
            s.tree = TokenTree.from_drafts(3, [(4, 2), (6, 5)], [None, None], [None, None])
            s.cache = Row(store, 10 + len(s.tree.tokens))
            s.group = type("G", (), {"observe": lambda *a: None})()
        s.seed = 1000 + i
        n = len(s.tree.tokens) if s.tree is not None else 4
        lg = (_logits([3, 4, 5, 6] if s.tree is None else [4, 2, 7, 1, 1]) if params.greedy else
              mx.array(rng.normal(size=(n, V)).astype(np.float32)))
        run.append((s, Slot(i, n, False)))
        out.append(lg)
    return run, out


def test_an_iteration_reads_every_block_decision_in_one_synchronisation(monkeypatch):
    """Greedy and sampled chains and trees in one iteration: every block's decision is read in
    ONE host synchronisation (an mx.eval, or a read of an array no mx.eval evaluated), not one
    per sampled session; and each session commits what it commits decided alone."""
    alone = []
    for s_sl, lg in zip(*_mixed_batch()):
        step, _ = _step()
        step.verified([s_sl], [None], [lg], None, 9.0)
        alone.append(s_sl[0].generated)
    syncs, evaluated = [], []
    real_eval, real_tolist, real_item = mx.eval, mx.array.tolist, mx.array.item

    def flat(args):
        for a in args:
            if isinstance(a, (list, tuple)):
                yield from flat(a)
            elif isinstance(a, dict):
                yield from flat(list(a.values()))
            else:
                yield a

    def counting_eval(*args):
        syncs.append("eval")
        evaluated.extend(flat(args))
        return real_eval(*args)

    def reading(real):
        def read(a, *args):
            if not any(a is e for e in evaluated):  # evaluated here: a synchronisation
                syncs.append(real.__name__)
            return real(a, *args)
        return read

    run, out = _mixed_batch()
    step, _ = _step()
    monkeypatch.setattr(mx, "eval", counting_eval)
    monkeypatch.setattr(mx.array, "tolist", reading(real_tolist))
    monkeypatch.setattr(mx.array, "item", reading(real_item))
    step.verified(run, [None] * len(run), out, None, 9.0)
    monkeypatch.undo()
    assert syncs == ["eval"], syncs
    assert [s.generated for s, _ in run] == alone
    assert all(len(g) >= 1 for g in alone) and len({tuple(g) for g in alone}) > 1
