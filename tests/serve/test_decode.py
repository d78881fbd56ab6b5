"""Each session's verified block -> accept -> commit (serve/decode.py), on given logits."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from engine_parts_kit import Scripted, session

from macfleet.engine.events import BlockDone, TokensCommitted
from macfleet.engine.proposers.base import Draft
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.tree import TokenTree
from macfleet.serve.costs import BatchCosts
from macfleet.serve.decode import BlockStep, read_iteration, to_host
from macfleet.serve.logprobs import LogprobsCommitted, row_logprobs
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
    s.kv_handle.cache = [Layer(10), Layer(10)]  # the prompt and the block [root, drafts] in it
    s.block.draft, s.block.k, s.block.draft_ms = Draft(draft), len(draft), 2.0
    return s


def test_a_chain_commits_its_accepted_drafts_and_the_next_token_and_rolls_back_the_rest():
    step, ended = _step()
    s = _chain()
    step.commit_chain(s, 9.0, (2, 7))
    assert s.generated == [3, 4, 7] and s.context[-3:] == [3, 4, 7]
    assert [c.offset for c in s.cache] == [9, 9]  # the rejected draft's entry dropped
    assert s.events == [TokensCommitted(1, (3, 4, 7))]
    assert s.proposer.observed == [(3, 2)] and (s.stats.trials, s.stats.hits) == (3, 2)
    assert step.costs.pool_totals() == (3, 2)
    tally = s.stats.tally
    assert (tally.blocks, tally.drafted, tally.accepted) == (1, 3, 2) and not ended


def test_the_outcome_given_decides():
    step, _ = _step()
    s = _chain()
    step.commit_chain(s, 9.0, outcome=(3, 6))
    assert s.generated == [3, 4, 5, 6]


def test_a_stop_token_cuts_the_block_and_ends_the_session():
    step, ended = _step()
    s = _chain(eos=frozenset({4}))
    step.commit_chain(s, 9.0, (2, 7))
    assert s.generated == [3] and s.events[-1] == TokensCommitted(1, (3,))
    assert ended == [(0, "stop")]


def test_the_length_ends_the_session():
    step, ended = _step()
    s = _chain(max_tokens=3)
    step.commit_chain(s, 9.0, (2, 7))
    assert ended == [(0, "length")]


def test_what_a_request_asked_for_comes_before_its_tokens():
    step, _ = _step()
    s = _chain()
    s.kv_handle.cached = 5
    s.req = s.req.__class__(**{**s.req.__dict__, "report_blocks": True, "logprobs": 1})
    rows = row_logprobs(_logits([3, 4, 7, 1]), 1)
    mx.eval(rows.arrays())
    step.commit_chain(s, 9.0, (2, 7), rows)
    kinds = [type(e) for e in s.events]
    assert kinds == [PromptReused, BlockDone, LogprobsCommitted, TokensCommitted]
    done = s.events[1]
    assert (done.k, done.drafted, done.accepted, done.committed) == (3, 3, 2, 3)
    assert len(s.events[2].entries) == 3


class Store:
    def __init__(self) -> None:
        self.kept = []

    def keep_paths(self, rows, fetched=None) -> None:
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
    tree_s.block.tree = TokenTree.from_drafts(3, [(4,), (6, 5)], [None, None], [None, None])
    tree_s.kv_handle.cache = Row(store, 10 + 4)  # the tree's 4 nodes after 10 committed positions
    tree_s.group = type("G", (), {"observe": lambda *a: None})()
    run = [(pre, Slot(1, 2, True)), (chain, Slot(0, 4, False)), (tree_s, Slot(2, 4, False))]
    out = [None, _logits([3, 4, 7, 1]), _logits([6, 1, 5, 2])]
    step.verified(run, [None] * 3, None, 9.0, read_iteration(run, out))
    assert pre.kv_handle.prefilled == 2 and pre.prefill_left == 1 and pre.prefill_ms == 0.0
    assert chain.generated == [3, 4, 7]
    assert tree_s.generated == [6, 5, 2]
    assert store.kept == [(tree_s.cache, 10, [2, 3])] and tree_s.cache.offset == 13
    step.verified([(pre, Slot(1, 1, True))], [None], None, 9.0,
                  read_iteration([(pre, Slot(1, 1, True))], [None]))
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
            s.block.tree = TokenTree.from_drafts(3, [(4, 2), (6, 5)], [None, None], [None, None])
            s.kv_handle.cache = Row(store, 10 + len(s.block.tree.tokens))
            s.group = type("G", (), {"observe": lambda *a: None})()
        s.seed = 1000 + i
        tree = s.block.tree
        n = len(tree.tokens) if tree is not None else 4
        lg = (_logits([3, 4, 5, 6] if tree is None else [4, 2, 7, 1, 1]) if params.greedy else
              mx.array(rng.normal(size=(n, V)).astype(np.float32)))
        run.append((s, Slot(i, n, False)))
        out.append(lg)
    return run, out


def _counting(monkeypatch):
    """Patch MLX so every host synchronisation is recorded: an mx.eval, or a read (tolist,
    item) of an array no mx.eval evaluated. Returns the record. (numpy conversions go
    through the buffer protocol, which cannot be patched: the code under test reads with
    numpy only arrays it evaluated.)"""
    syncs, evaluated = [], []
    real_eval = mx.eval

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

    def reading(real, name):
        def read(a, *args, **kw):
            if not any(a is e for e in evaluated):  # evaluated here: a synchronisation
                syncs.append(name)
            return real(a, *args, **kw)
        return read

    monkeypatch.setattr(mx, "eval", counting_eval)
    for name in ("tolist", "item"):
        monkeypatch.setattr(mx.array, name, reading(getattr(mx.array, name), name))
    return syncs


def test_an_iteration_reads_every_block_decision_in_one_synchronisation(monkeypatch):
    """Greedy and sampled chains and trees in one iteration: every block's decision is read in
    ONE host synchronisation (an mx.eval, or a read of an array no mx.eval evaluated), not one
    per sampled session; and each session commits what it commits decided alone."""
    alone = []
    for s_sl, lg in zip(*_mixed_batch()):
        step, _ = _step()
        step.verified([s_sl], [None], None, 9.0, read_iteration([s_sl], [lg]))
        alone.append(s_sl[0].generated)
    run, out = _mixed_batch()
    step, _ = _step()
    syncs = _counting(monkeypatch)
    step.verified(run, [None] * len(run), None, 9.0, read_iteration(run, out))
    monkeypatch.undo()
    assert syncs == ["eval"], syncs
    assert [s.generated for s, _ in run] == alone
    assert all(len(g) >= 1 for g in alone) and len({tuple(g) for g in alone}) > 1


def test_reading_dispatched_decisions_waits_for_nothing_dispatched_after_them():
    """The engine reads iteration n after it dispatched n + 1 (its step ahead): the read waits
    for n's decisions only. An op built on them at the read would be queued on the device
    behind n + 1, and the host's next dispatch would wait for all of n + 1 (the device idle
    while the host then builds it)."""
    decided = {3: mx.array([1, 5], dtype=mx.int32), 4: mx.argmax(_logits([2, 6]), axis=-1)}
    mx.async_eval(list(decided.values()))
    a = mx.random.normal((1536, 1536))
    mx.eval(a)
    later = a @ a @ a  # what went out behind them: a long forward
    mx.async_eval(later)
    t0 = time.perf_counter()
    got = to_host(decided)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mx.eval(later)
    assert got == {3: [1, 5], 4: [2, 6]}
    assert read_s < time.perf_counter() - t0  # read while `later` still ran


# -- the whole iteration, forward included (a real model) -------------------------------
class Feeding(Scripted):
    """A host-side drafter that also reads the verifier's hidden states (as EAGLE does)."""

    wants_features = True

    def __init__(self, drafts) -> None:
        super().__init__(drafts)
        self.fed: list[tuple[int, tuple[int, ...]]] = []

    def untap(self) -> None:
        pass

    def feed_features(self, start, tokens, hidden) -> None:
        self.fed.append((start, tuple(tokens)))


class WithProbs(Scripted):
    """Drafts with the distributions they came from: a tree of them is SpecInfer's."""

    def __init__(self, drafts, vocab: int) -> None:
        super().__init__(drafts)
        self.vocab = vocab

    def propose(self, context, k) -> Draft:
        d = super().propose(context, k)
        q = np.full((len(d.tokens), self.vocab), 0.5 / (self.vocab - 1))
        q[np.arange(len(d.tokens)), list(d.tokens)] = 0.5
        return Draft(d.tokens, q)


class Oracle(Scripted):
    """Drafts the answer it is given (a greedy answer served alone): in a tree beside a wrong
    branch, its accepted path is not the first nodes, so the row's kept nodes move."""

    def __init__(self, answer, prompt_len: int) -> None:
        super().__init__()
        self.answer, self.prompt_len = list(answer), prompt_len

    def propose(self, context, k) -> Draft:
        t = len(context) - self.prompt_len
        return Draft(tuple(self.answer[t:t + 2]))


def _greedy_answer(lm, prompt, n):
    from macfleet.serve.engine import BatchEngine, EngineRequest

    eng, out = BatchEngine(lm, proposer="none"), []
    eng.submit(EngineRequest(prompt, GREEDY, n), out.append)
    eng.run_until_idle()
    return [t for e in out if isinstance(e, TokensCommitted) for t in e.tokens]


def _mixed_engine(lm, keep=range(6)):
    """An engine decoding greedy and sampled chains and trees at once: a chain whose drafter
    reads hidden states, a request with logprobs, a SpecInfer tree, a plain session."""
    from macfleet.engine.proposers.group import ProposerGroup
    from macfleet.serve.engine import BatchEngine, EngineRequest

    V = lm.vocab_size
    eng = BatchEngine(lm, proposer="none", draft_tokens=3)
    hot = SamplingParams(0.9, seed=7)
    many = 200
    feeding = Feeding([(5, 6, 7)] * many)
    reqs = [
        (EngineRequest((1, 2, 3, 4), GREEDY, 40), feeding),
        (EngineRequest((9, 8, 7, 6), hot, 40), Scripted([(5, 6, 7)] * many)),
        (EngineRequest((11, 12, 13), GREEDY, 40, logprobs=2),
         ProposerGroup([Scripted([(60, 61)] * many),
                        Oracle(_greedy_answer(lm, (11, 12, 13), 40), 3)], draft_tokens=2)),
        (EngineRequest((21, 22, 23), hot, 40),
         ProposerGroup([Scripted([(5, 6)] * many), Scripted([(3, 9)] * many)], draft_tokens=2)),
        (EngineRequest((31, 32, 33), SamplingParams(0.8, seed=3), 40, logprobs=0),
         ProposerGroup([WithProbs([(5, 6)] * many, V), WithProbs([(3, 9)] * many, V)],
                       draft_tokens=2)),
        (EngineRequest((41, 42, 43), GREEDY, 40), None),
    ]
    got: dict[int, list] = {i: [] for i in keep}
    for i in keep:
        eng.submit(reqs[i][0], got[i].append, proposer=reqs[i][1])
    return eng, got, feeding


@pytest.mark.slow
def test_a_whole_iteration_forward_included_is_one_synchronisation(monkeypatch):
    """The serving engine's iteration, forward included, over greedy and sampled chains and
    trees (SpecInfer's too), a hidden-state drafter and a logprobs request: ONE host
    synchronisation per iteration (the forward left lazy, the decisions built on its logits,
    all evaluated together), not the forward's evaluation and then the decisions' read."""
    from macfleet.engine.models import load_model

    lm = load_model("tiny:1:64")
    eng, got, feeding = _mixed_engine(lm)
    eng.step()  # admission and every prompt's prefill (and the drafters' verify(L) probe)
    assert all(s.prefill_left <= 0 for s in eng.table.active) and len(eng.table.active) == 6
    from macfleet.engine.batch_kv import BatchKV

    real_keep, moved = BatchKV.keep_paths, []

    def keep_paths(store, kept, fetched=None):
        moved.extend(list(p) != list(range(1, len(p) + 1)) for _, _, p in kept)
        return real_keep(store, kept, fetched)

    for _ in range(3):
        monkeypatch.setattr(BatchKV, "keep_paths", keep_paths)
        syncs = _counting(monkeypatch)
        assert eng.step()
        monkeypatch.undo()
        assert syncs == ["eval"], syncs
    assert any(moved)  # a tree's accepted path moved in the store: no wait for it either
    committed = [sum(len(e.tokens) for e in evs if isinstance(e, TokensCommitted))
                 for evs in got.values()]
    assert all(n >= 3 for n in committed), committed  # every session decoded each iteration
    assert any(isinstance(e, LogprobsCommitted) for e in got[2])
    assert any(isinstance(e, LogprobsCommitted) for e in got[4])
    assert len(feeding.fed) >= 4  # the prompt's rows, then each block's


@pytest.mark.slow
def test_a_mixed_batch_commits_what_each_request_commits_alone():
    """The one-synchronisation iteration changes no answer: each request of the mixed batch
    (seeded samples included) gets what it gets served alone."""
    from macfleet.engine.models import load_model

    lm = load_model("tiny:1:64")

    def answers(keep=range(6)):
        eng, got, _ = _mixed_engine(lm, keep)
        eng.run_until_idle()
        return {i: [t for e in evs if isinstance(e, TokensCommitted) for t in e.tokens]
                for i, evs in got.items()}

    batched = answers()
    assert all(batched.values()) and len({tuple(v) for v in batched.values()}) == 6
    for i in range(6):
        assert answers([i])[i] == batched[i], i
