"""Retrieval drafts from a store of the verifier's own answers: lookup, trees, lossless use.

Token ids: the "greedy margin" rule of tests/tolerance.py (trees vs plain decoding).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from macfleet.engine import fastmath
from macfleet.distill.dataset import merged_store, save_store, store_answers
from macfleet.engine.events import Finished
from reference_loops import speculative_generate
from macfleet.engine.models import load_model
from macfleet.engine.proposers import ProposerSpecError, make_proposer
from macfleet.engine.proposers.retrieval import (SEPARATOR, Datastore, RetrievalProposer,
                                                 build_tree)
from macfleet.engine.proposers.group import ProposerGroup, tree_budget
from reference_loops import tree_generate
from macfleet.engine.verifier import Verifier


def test_longest_suffix_matches_first_and_the_trie_weights_sum_by_prefix():
    store = Datastore.build([[1, 2, 3, 4, 5, 6], [9, 3, 4, 5, 7], [3, 4, 8]])
    m = store.matches([0, 2, 3, 4], limit=8)
    assert m[0][1] == 3  # "2 3 4" occurs once: the longest suffix found first
    assert {n for _, n in m} == {3, 2}  # shorter suffixes fill up the matches
    toks, parents, weight = build_tree(store, m, depth=3)
    assert toks[0] == 5 and parents[0] == -1
    assert all(-1 <= p < i for i, p in enumerate(parents))
    # a node's weight is at most its parent's; siblings at the root share the whole mass
    assert all(weight[i] <= weight[p] + 1e-9 for i, p in enumerate(parents) if p >= 0)
    assert sum(w for w, p in zip(weight, parents) if p < 0) == pytest.approx(1.0)
    assert SEPARATOR not in toks


def test_every_match_is_exact_and_finds_every_occurrence():
    rng = np.random.default_rng(3)
    answers = [rng.integers(0, 6, rng.integers(5, 40)).tolist() for _ in range(60)]
    store = Datastore.build(answers)
    toks = store.tokens.tolist()
    for _ in range(100):
        a = answers[rng.integers(len(answers))]
        ctx = [7, *a[: rng.integers(2, len(a))]]
        got = store.matches(ctx, limit=10_000)
        for n in (8, 6, 4, 3, 2):  # brute force: where does the last-n suffix occur?
            want = {p + n for p in range(len(toks) - n + 1) if toks[p:p + n] == ctx[-n:]}
            have = {after for after, m in got if m >= n}
            assert have <= want  # a match of a longer suffix is one of the shorter too
            assert {after for after, m in got if m == n} == want - {
                after for after, m in got if m > n}
    assert store.matches([70_000, 1, 2], limit=8) == store.matches([1, 2], limit=8)


def test_a_crowded_match_is_sampled_evenly_over_its_continuations():
    # "2 3" is followed by 7 in the first 60 answers and by 9 in the last 20: the matches
    # kept must keep those shares (the first ones by position would all continue with 7)
    store = Datastore.build([[1, 2, 3, 7]] * 60 + [[1, 2, 3, 9]] * 20)
    m = store.matches([5, 2, 3], limit=8)
    nxt = [int(store.tokens[after]) for after, _ in m]
    assert len(m) == 8 and nxt.count(7) == 6 and nxt.count(9) == 2


def test_no_match_drafts_nothing_and_a_store_round_trips(tmp_path):
    store = Datastore.build([[1, 2, 3], [4, 5, 6]])
    prop = RetrievalProposer(store)
    assert len(prop.propose([7, 8, 9], 8)) == 0
    again = Datastore.load(save_store(store, tmp_path / "s"))
    assert (again.tokens == store.tokens).all() and again.tokens.dtype == np.uint16


def _answers(lm, n, length, seed):
    """`n` greedy answers of `length` tokens to random 6-token prompts, decoded as one batch
    (tests/eagle_fixtures.py's `greedy_batch`: the verifier's own answers, as generate_step
    gives them one at a time)."""
    from eagle_fixtures import greedy_batch

    return greedy_batch(lm, n, length, seed, prompt_len=6)[1]


@pytest.mark.slow  # generates 30 answers for its store
def test_retrieval_trees_are_lossless_and_accept_the_verifiers_habits(tmp_path, monkeypatch):
    # the tree's shape follows verify(L): a fixed bandwidth-bound table, not the probe of the
    # machine running the suite (a loaded probe, or a table memoised for another model of the
    # worker, once gave trees that held none of the verifier's tokens: 0 of 245 accepted)
    monkeypatch.setattr("reference_loops.verify_costs",
                        lambda model: {L: 10.0 + 0.2 * (L - 1) for L in (1, 2, 4, 8, 16, 32)})
    # nothing shared with the worker's other tests: its own model (not the load cache's) and
    # its own index cache (the full suite once accepted 0 of 212 drafts here, alone never)
    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path / "cache"))
    lm = load_model("tiny:5:32", cached=False)
    prompt = [3, 1, 4, 1, 5, 9]
    alone = list(speculative_generate(Verifier(lm.model), None, prompt, max_tokens=48))[-1]
    # the store holds the verifier's answers to other prompts and, as a store built from a
    # dataset holds a request seen before, its answer to this one: without it the random tiny
    # model's "habits" gave a few accepted tokens or none, by the tree sizes' timing (0 of
    # 133-250 drafts in 3 of 4 runs alone)
    store = Datastore.build([*_answers(lm, 30, 60, seed=0), list(alone.token_ids)])
    path = save_store(store, tmp_path / "answers")
    prop = make_proposer(f"retrieval:{path}", lm)
    assert prop.drafts_trees
    fin = list(tree_generate(Verifier(lm.model), ProposerGroup([prop], node_budget=tree_budget(
        [prop])), prompt, max_tokens=48))[-1]
    assert isinstance(fin, Finished) and fin.token_ids == alone.token_ids
    assert fin.stats.accepted > 0 and fin.stats.blocks < 48, _why(fin, alone, prompt)


def _why(fin, alone, prompt) -> str:
    """What a failure needs to be understood (evaluated only on failure): the process's
    switches, the drafts' stats and the verifier's answer."""
    seen = {k: v for k, v in os.environ.items() if k.startswith("MACFLEET")}
    return (f"fastmath {fastmath.enabled()}, env {seen}; stats "
            f"{fin.stats}; prompt {prompt}, answer {alone.token_ids}")


def test_a_store_for_another_vocabulary_is_refused(tmp_path):
    lm = load_model("tiny:5:32")
    path = save_store(Datastore.build([[1, 2, 300, 4]]), tmp_path / "big")
    with pytest.raises(ProposerSpecError, match="vocabulary"):
        make_proposer(f"retrieval:{path}", lm)
    with pytest.raises(ProposerSpecError, match="macfleet distill"):
        make_proposer("retrieval", lm)  # nothing shipped for a tiny model


def test_a_store_grows_across_datasets_without_repeating_an_answer(tmp_path):
    a, b, c = [5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 9]
    s1 = Datastore.build([a, b])
    assert [x.tolist() for x in store_answers(s1)] == [a, b]
    s2 = merged_store(s1, [b, c, []])  # b is already there: kept once
    assert [x.tolist() for x in store_answers(s2)] == [a, b, c]
    loaded = Datastore.load(save_store(s2, tmp_path / "store.npy"))
    assert [x.tolist() for x in store_answers(loaded)] == [a, b, c]
    # the merged store's trie weights count each distinct answer once
    assert len(loaded.matches([5, 6, 7], 10)) == 2
    assert store_answers(Datastore.build([])) == []
    assert store_answers(merged_store(Datastore.build([]), [a]))[0].tolist() == a


def test_a_warm_up_builds_the_shipped_index_once(tmp_path, monkeypatch):
    import macfleet.engine.proposers.retrieval as r

    path = save_store(Datastore.build([[1, 2, 3, 4], [2, 3, 5]]), tmp_path / "answers")
    monkeypatch.setattr(r, "default_store_path", lambda spec: path if spec == "m" else None)
    monkeypatch.setattr(r, "_loaded", {})
    assert not r.warm_store("other")  # nothing shipped: nothing to build
    assert r.warm_store("m")
    built = r._loaded[str(path.resolve())][0]

    class V:
        spec, vocab_size = "m", 8

    assert r.make_retrieval_proposer("", V()).store is built  # the request found it built


def test_a_loaded_store_keeps_its_index_in_the_cache(tmp_path, monkeypatch):
    import macfleet.engine.proposers.retrieval as r

    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path / "cache"))
    store = Datastore.build([[1, 2, 3, 4, 5], [2, 3, 4, 9], [7, 2, 3]])
    path = save_store(store, tmp_path / "answers")
    first = Datastore.load(path)  # built, then cached
    cached = sorted(p.name for p in (tmp_path / "cache" / "retrieval").iterdir())
    assert len(cached) == 1 and not cached[0].startswith(".tmp")
    calls = []
    monkeypatch.setattr(r.Datastore, "from_tokens",
                        classmethod(lambda cls, toks: calls.append(1)))
    again = Datastore.load(path)  # read back: no sort
    assert calls == [] and isinstance(again.order, np.memmap)
    assert again.matches([0, 2, 3], 8) == first.matches([0, 2, 3], 8) == store.matches(
        [0, 2, 3], 8)
    # another store's tokens never read this one's index
    monkeypatch.undo()
    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path / "cache"))
    other = save_store(Datastore.build([[5, 6, 7]]), tmp_path / "other")
    assert Datastore.load(other).matches([5, 6], 4) == [(2, 2)]
    for f in (tmp_path / "cache" / "retrieval").glob("*/hi.npy"):  # a damaged cache: rebuilt
        f.write_bytes(b"junk")
    assert Datastore.load(path).matches([0, 2, 3], 8) == store.matches([0, 2, 3], 8)



def test_a_store_tree_is_sized_by_what_its_blocks_told_it():
    """The sizing the tree drafters share (tree_budget.TreeSizing): verify(L) seeded and
    learnt, and node probabilities trusted as far as the blocks' acceptance bore them out."""
    prop = RetrievalProposer(Datastore.build([[1, 2, 3, 4, 5, 6]] * 3 + [[2, 3, 7]]))
    prop.seed_verify_costs({1: 10.0, 8: 10.5})  # drafting pays: a flat curve
    assert prop.curve.cost(8) == pytest.approx(10.5)
    draft = prop.propose([9, 1, 2, 3], 8)
    assert len(draft) > 0
    for _ in range(60):  # none of its drafts is ever accepted
        prop.observe(len(draft), 0, 10.0)
    assert prop.calibration.gain < 0.5
    assert prop.curve.cost(len(draft) + 1) == pytest.approx(10.0, rel=0.05)
