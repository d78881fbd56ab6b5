"""EAGLE-2 dynamic trees: tree drafts, the size decision, lossless greedy and sampling.

Token ids: the "greedy margin" rule of tests/tolerance.py (trees vs plain decoding);
"same path" for a seeded run repeated with fixed tree sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from macfleet.distill.heads import save_head
from macfleet.engine.tree_budget import (Calibration, VerifyCurve, choose_tree_size,
                                         worth_expanding)
from macfleet.engine.proposers.eagle.tree import EagleTreeProposer
from macfleet.engine.events import Finished
import reference_loops as tree_loop
from reference_loops import speculative_generate
from macfleet.engine.proposers.base import sanitize_draft
from macfleet.engine.proposers.base import Draft
from macfleet.engine.sampling import SamplingParams, probs_from_logits
from macfleet.engine.tree import TokenTree, accept_tree_sample, ancestor_mask

from macfleet.engine.proposers.group import ProposerGroup, tree_budget
from reference_loops import tree_generate
from macfleet.engine.tree_verify import tree_forward
from macfleet.engine.verifier import Verifier

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_a_tree_draft_merges_with_a_chain_and_counts_its_own_nodes():
    # draft 0: a tree  (7 -> 8, 7 -> 9, 5);  draft 1: the chain 7 8 4
    t = TokenTree.from_drafts(1, [[7, 5, 8, 9], [7, 8, 4]], None, [(-1, -1, 0, 0), None])
    assert t.tokens == [1, 7, 5, 8, 9, 4]
    assert t.parents == [-1, 0, 0, 1, 1, 3]
    assert t.depths == [0, 1, 1, 2, 2, 3]
    assert sorted(map(tuple, t.paths)) == [(1, 3), (1, 3, 5), (1, 4), (2,)]
    assert t.accepted_per_source([1, 3, 5]) == [2, 3]
    m = ancestor_mask(t.parents)
    assert m[5].tolist() == [True, True, False, True, False, True]


def test_sanitize_keeps_the_valid_prefix_of_a_tree():
    d = Draft((4, 5, 6, 7), parents=(-1, 0, 5, 1))  # node 2 names a later parent
    s = sanitize_draft(d, 8, 16)
    assert s.tokens == (4, 5) and s.parents == (-1, 0)
    assert sanitize_draft(Draft((4, 5, 99), parents=(-1, 0, 1)), 8, 16).parents == (-1, 0)
    assert sanitize_draft(Draft((4, 5), parents=(-1, 0)), 8, 16).parents == (-1, 0)


def test_tree_size_grows_with_confidence_and_shrinks_with_verify_cost():
    flat = [1.0 + 0.01 * n for n in range(25)]
    steep = [1.0 + 0.5 * n for n in range(25)]
    sure = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1]
    assert choose_tree_size([0.001] * 10, flat) == 0  # nothing likely: plain decoding
    assert choose_tree_size(sure, flat) == 10
    assert 0 < choose_tree_size(sure, steep) < 5
    assert choose_tree_size(sure, flat, gain=0.0) == 0  # a head that is never right


def test_a_deeper_level_is_drafted_only_while_it_can_pay_for_its_head_forward():
    # the beam's mass bounds what its children can add; each token saves a verifier step
    assert worth_expanding([0.5, 0.2], gain=1.0, depth_ms=4.0, step_ms=45.0)
    assert not worth_expanding([0.05, 0.02, 0.01], gain=1.0, depth_ms=4.0, step_ms=45.0)
    assert not worth_expanding([0.5, 0.2], gain=0.1, depth_ms=4.0, step_ms=45.0)  # overconfident
    # a fast verifier step (a Mac GPU) next to a slow head: shallow trees
    assert not worth_expanding([0.3], gain=1.0, depth_ms=4.0, step_ms=10.0)


def test_verify_curve_is_a_measured_table_and_calibration_tracks_acceptance():
    c = VerifyCurve()
    assert c.costs(2) == pytest.approx([1.0, 1.05, 1.1])  # prior, relative units
    # a CPU's sawtooth (SmolLM2 on the 2-core box): 16 rows cost less than 12
    c.seed({1: 39.0, 4: 64.0, 12: 102.0, 16: 68.0})
    assert c.cost(16) < c.cost(12) and c.cost(8) == pytest.approx(83.0)  # interpolated
    assert c.cost(32) > c.cost(16)  # beyond the table: the prior slope
    for _ in range(20):
        c.observe(12, 70.0)  # the loop measures better: the table follows
    assert c.cost(12) == pytest.approx(70.0, rel=0.05)
    probs = [0.6, 0.4, 0.3, 0.2] + [0.05] * 12
    assert choose_tree_size(probs, VerifyCurve(table={1: 39.0, 4: 64.0, 12: 102.0,
                                                      16: 68.0}).costs(16)) == 15
    cal = Calibration()
    for _ in range(60):
        cal.observe(predicted=4.0, accepted=1)
    assert cal.gain == pytest.approx(0.25, rel=0.1)


def _check_tree(d: Draft) -> None:
    assert d.parents is not None and len(d.parents) == len(d.tokens)
    assert all(-1 <= p < i for i, p in enumerate(d.parents))


def _costly_verifier(monkeypatch) -> None:
    """The tiny verifier costs as little as its head, so trees would never pay (and are not
    drafted); measure instead as if verifying were the big model's step (a flat GPU-like
    curve), so that these tests see trees. Sizes are still chosen by the real code."""
    monkeypatch.setattr(tree_loop, "verify_costs", lambda model: {1: 100.0, 16: 105.0,
                                                                  32: 120.0})


def test_eagle2_greedy_is_bit_identical_and_drafts_branching_trees(tiny, trained, monkeypatch):
    _costly_verifier(monkeypatch)
    alone = list(speculative_generate(Verifier(tiny.model), None, PROMPT, max_tokens=48))[-1]
    prop = EagleTreeProposer(trained)
    seen: list[Draft] = []
    propose = prop.propose

    def spy(context, k):
        d = propose(context, k)
        seen.append(d)
        return d

    prop.propose = spy
    group = ProposerGroup([prop], node_budget=tree_budget([prop]))
    fin = list(tree_generate(Verifier(tiny.model), group, PROMPT, max_tokens=48))[-1]
    assert isinstance(fin, Finished) and fin.token_ids == alone.token_ids
    assert fin.stats.accepted > 0 and fin.stats.blocks < 48
    trees = [d for d in seen if len(d)]
    for d in trees:
        _check_tree(d)
    assert any(len(set(d.parents)) < len(d.parents) for d in trees), "no branching tree drafted"
    assert prop.fallback_tokens == 0  # features came from the verifier's tree forwards


def test_eagle2_deeper_levels_draft_from_the_frequent_prefix_and_stay_lossless(
        tiny, chunks, trained, monkeypatch):
    """A head whose draft ids are most frequent first: levels below the first draft only
    the first `deep_vocab` of them (the first level all); greedy output is the verifier's."""
    from macfleet.distill.train import choose_draft_vocab

    _costly_verifier(monkeypatch)
    ids = choose_draft_vocab(chunks, 24, tiny.vocab_size)
    trained.set_draft_vocab(ids, "frequency")
    try:
        alone = list(speculative_generate(Verifier(tiny.model), None, PROMPT,
                                          max_tokens=48))[-1]
        prop = EagleTreeProposer(trained, deep_vocab=6)
        seen: list[Draft] = []
        propose = prop.propose
        prop.propose = lambda c, k: seen.append(propose(c, k)) or seen[-1]
        group = ProposerGroup([prop], node_budget=tree_budget([prop]))
        fin = list(tree_generate(Verifier(tiny.model), group, PROMPT, max_tokens=48))[-1]
    finally:
        trained.set_draft_vocab(None)
    assert isinstance(fin, Finished) and fin.token_ids == alone.token_ids
    deep = [t for d in seen if len(d) for t, p in zip(d.tokens, d.parents) if p >= 0]
    assert deep, "no level below the first was drafted"
    assert set(deep) <= set(ids[:6].tolist())
    first = {t for d in seen if len(d) for t, p in zip(d.tokens, d.parents) if p < 0}
    assert first <= set(ids.tolist())


def test_eagle2_in_a_chain_loop_still_lossless(tiny, trained):
    """A tree drafter handed to the chain loop: its tokens are checked as a chain; the output
    stays the verifier's (speed is lost, never correctness)."""
    alone = list(speculative_generate(Verifier(tiny.model), None, PROMPT, max_tokens=24))[-1]
    fin = list(speculative_generate(Verifier(tiny.model), EagleTreeProposer(trained), PROMPT,
                                    max_tokens=24))[-1]
    assert fin.token_ids == alone.token_ids


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/engine: engine_testkit
    from engine_testkit import chi2_test

    stat, _, crit = chi2_test(counts, probs)
    return stat, crit


@pytest.fixture(scope="module")
def sampled_tree(tiny, trained):
    """A real EAGLE-2 tree on the tiny verifier and the verifier's p at every node."""
    params = SamplingParams(temperature=3.0, top_p=1.0, seed=0)  # flat p: many cells to test
    v = Verifier(tiny.model)
    v.prefill(PROMPT[:-1])
    prop = EagleTreeProposer(trained)
    prop.start(params)
    prop.calibration.predicted = prop.calibration.accepted = 1.0
    d = prop.propose(PROMPT, 24)
    prop.close()
    _check_tree(d)
    tree = TokenTree.from_drafts(PROMPT[-1], [d.tokens], None, [d.parents])
    p = probs_from_logits(tree_forward(v, tree), params)
    return tree, p, params


def test_eagle2_tree_sampling_keeps_the_verifier_distribution(tiny, sampled_tree):
    tree, p, _ = sampled_tree
    rng = np.random.default_rng(5)
    V = p.shape[1]
    first = np.zeros(V)
    # the first two tokens, given the first is a drafted child that has children of its own:
    # expected p(t1) * p(t2 | t1), renormalised over those t1
    inner = [c for c in tree.children[0].values() if tree.children[c]]
    assert inner, "the tree has no depth-2 node"
    row = {c: i for i, c in enumerate(inner)}
    joint = np.zeros((len(inner), V))
    for _ in range(30000):
        path, nxt = accept_tree_sample(tree, p, rng)
        toks = [*tree.path_tokens(path), nxt]
        first[toks[0]] += 1
        if path and path[0] in row:
            joint[row[path[0]], toks[1]] += 1
    stat, crit = _chi2(first, p[0])
    assert stat < crit, (stat, crit)
    expect = np.stack([p[0][tree.tokens[c]] * p[c] for c in inner])
    stat, crit = _chi2(joint, expect / expect.sum())
    assert stat < crit, (stat, crit)
    # the same counts are rejected against a distribution the drafts would bias towards
    q = np.zeros(V)
    q[[tree.tokens[c] for c in tree.children[0].values()]] = 1.0
    biased = 0.5 * p[0] + 0.5 * q / q.sum()
    stat, crit = _chi2(first, biased)
    assert stat > crit


def test_eagle2_sampling_loop_is_seeded(tiny, trained):
    params = SamplingParams(temperature=0.9, top_p=1.0, seed=7)
    outs = []
    for _ in range(2):
        prop = EagleTreeProposer(trained)
        prop.curve.observe = lambda length, ms: None  # tree sizes must not follow timings
        group = ProposerGroup([prop], node_budget=tree_budget([prop]))
        outs.append(list(tree_generate(Verifier(tiny.model), group, PROMPT, params=params,
                                       max_tokens=30))[-1].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 30


def test_backoff_skips_a_drafter_that_keeps_drafting_nothing_and_probes_again():
    from macfleet.engine.tree_budget import Backoff

    b = Backoff(patience=2, max_skip=4)
    pattern = []
    for _ in range(14):
        d = b.should_draft()
        pattern.append(d)
        if d:
            b.observe(0, 0)  # it looked, and chose an empty tree
    assert pattern[:2] == [True, True] and pattern[2:4] == [False, False]
    assert pattern.count(False) >= 8  # the skips grow (2, 4, 4, ...)
    while not b.should_draft():  # the current skip runs out, then a probe drafts
        pass
    b.observe(3, 0)  # drafts that miss are not its business
    b.observe(3, 2)  # a hit resets it
    for _ in range(2):
        assert b.should_draft()
        b.observe(0, 0)
    assert not b.should_draft()  # skipping 2 again, not 4


@pytest.mark.parametrize("tree", [False, True])  # eagle chains | eagle2 trees
def test_hidden_state_drafters_in_the_continuous_batch(tiny, trained, tree):
    """Several sessions with their own EAGLE drafter share the flat forward: each drafter is
    fed its session's rows of it (prefill chunks, blocks, a tree's kept path), computes no
    feature itself, and every answer is the verifier's greedy one ("greedy margin")."""
    from macfleet.engine.proposers.eagle.chain import EagleProposer
    from macfleet.engine.events import Finished as Done
    from macfleet.engine.sampling import GREEDY
    from macfleet.serve.engine import BatchEngine, EngineRequest

    prompts = [PROMPT, PROMPT[::-1], [5, 5, 2, 7, 1, 8, 2, 8], [1, 2, 3, 4, 1, 2, 3]]
    eng = BatchEngine(tiny, proposer="none", max_active=4)
    drafters, out = [], {}
    for i, p in enumerate(prompts):
        d = EagleTreeProposer(trained) if tree else EagleProposer(trained)
        if tree:  # a flat, slow verifier, kept so: trees pay whatever this machine's timings
            d.seed_verify_costs({n: 1000.0 for n in range(1, 65)})
            d.seed_verify_costs = d.curve.observe = lambda *a, **k: None
        drafters.append(d)
        drafting = ProposerGroup([d], node_budget=tree_budget([d])) if tree else d
        eng.submit(EngineRequest(tuple(p), GREEDY, 32, draft_tokens=3),
                   lambda ev, i=i: isinstance(ev, Done) and out.__setitem__(i, ev),
                   proposer=drafting)
    eng.run_until_idle()
    for i, p in enumerate(prompts):
        alone = list(speculative_generate(Verifier(tiny.model), None, p, max_tokens=32))[-1]
        assert out[i].token_ids == alone.token_ids
    assert sum(f.stats.accepted for f in out.values()) > 0
    assert max(r.sessions for r in eng.history) > 1
    assert all(d.fallback_tokens == 0 for d in drafters)


@pytest.mark.slow  # generates answers to the unseen prompts and the held-out ones
def test_bench_tree_shapes_end_to_end_on_the_tiny_model(tiny, trained, tmp_path, capsys):
    import json
    import subprocess
    import sys

    save_head(trained, tmp_path / "head")
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "macfleet", "bench", "--model", tiny.spec, "--out", str(out),
           "tree-shapes", "2,3,0", "3,2,0", "--head", str(tmp_path / "head"),
           "--max-tokens", "10", "--step", "3", "--repeats", "1", "--loop-tokens", "16"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((out / "tree_shapes.json").read_text())
    shapes = doc["offline"]["shapes"]
    assert set(shapes) == {"top2 depth3 deepall", "top3 depth2 deepall"}
    for row in shapes.values():
        assert row["starts"] > 0 and row["draft_ms_median"] > 0
        acc = [row["all"][str(n)] for n in doc["offline"]["nodes"]]
        assert acc == sorted(acc)  # a bigger tree of the best nodes contains the smaller one
        assert all(0 <= a <= 3 for a in acc)
    loop = doc["in_loop"]["summary"]["all"]
    assert set(loop) == {"none", *shapes} and all(s["all_identical"] for s in loop.values())
    assert doc["in_loop"]["max_tokens"] == 16
    # the CLI's refusals, in this process (`macfleet` exits with main's 2): both before a model
    # is loaded
    from macfleet.cli.main import main

    for bad, says in ((["4,5"], "TOP_K,MAX_DEPTH,DEEP_VOCAB"),
                      (["2,3,0", "--loop-tokens", "0"], "--loop-tokens >= 1")):
        assert main([*cmd[3:cmd.index("tree-shapes") + 1], *bad]) == 2
        assert says in capsys.readouterr().err
