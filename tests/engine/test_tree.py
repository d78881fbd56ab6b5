"""Token trees: merging, the ancestor mask, one-forward verification, lossless acceptance.

Token ids: the "greedy margin" rule of tests/tolerance.py (a tree forward vs chains);
"same path" for a seeded run repeated with fixed draft lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_testkit import Draws, chi2_critical

from macfleet.engine.events import Finished
from reference_loops import speculative_generate
from macfleet.engine.models import load_model
from macfleet.engine.proposers import make_proposer
from macfleet.engine.proposers.base import Draft, Proposer
from macfleet.engine.proposers.model_draft import ModelProposer
from macfleet.engine.sampling import GREEDY, SamplingParams, make_rng
from macfleet.engine.tree import (Candidate, TokenTree, accept_tree_greedy, accept_tree_sample,
                                  ancestor_mask)
from macfleet.engine.proposers.group import ProposerGroup
from reference_loops import tree_generate
from macfleet.engine.tree_verify import compact_cache, tree_forward
from macfleet.engine.verifier import Verifier
from tolerance import LOGIT_ATOL, LOGIT_RTOL


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    exp = probs * counts.sum()
    keep = exp > 5
    return float((((counts - exp) ** 2)[keep] / exp[keep]).sum()), int(keep.sum()) - 1


def test_merge_shares_prefixes_and_masks_ancestors():
    t = TokenTree.from_drafts(9, [[1, 2, 3], [1, 2, 4], [5]])
    assert t.tokens == [9, 1, 2, 3, 4, 5] and t.parents == [-1, 0, 1, 2, 2, 0]
    assert t.depths == [0, 1, 2, 3, 3, 1] and t.size == 5
    m = ancestor_mask(t.parents)
    assert m[4].tolist() == [True, True, True, False, True, False]
    assert m[5].tolist() == [True, False, False, False, False, True]
    assert t.accepted_per_source([1, 2, 4]) == [2, 3, 0]


@pytest.mark.parametrize("spec", ["tiny:1", "tiny:2:300"])
def test_one_forward_equals_each_branch_and_compaction_is_exact(spec):
    lm = load_model(spec)
    rng = np.random.default_rng(1)
    prompt = [int(x) for x in rng.integers(0, lm.vocab_size, 12)]
    a = [int(x) for x in rng.integers(0, lm.vocab_size, 4)]
    drafts = [a, a[:2] + [int(x) for x in rng.integers(0, lm.vocab_size, 2)], [a[0] + 1]]
    v = Verifier(lm.model)
    v.prefill(prompt[:-1])
    tree = TokenTree.from_drafts(prompt[-1], drafts)
    base = v.offset
    lt = np.array(tree_forward(v, tree))
    for j, chain in enumerate(drafts):
        ref = Verifier(lm.model)
        ref.prefill(prompt[:-1])
        lc = np.array(ref.forward([prompt[-1], *chain]))
        for row, node in enumerate([0, *tree.paths[j]]):
            np.testing.assert_allclose(lt[node], lc[row], rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
            assert lt[node].argmax() == lc[row].argmax()
    path = tree.paths[1]
    compact_cache(v, base, path)
    assert v.offset == base + 1 + len(path)
    nxt = int(lt[path[-1]].argmax())
    ref = Verifier(lm.model)
    ref.prefill(prompt[:-1])
    want = np.array(ref.forward([prompt[-1], *tree.path_tokens(path), nxt]))[-1]
    np.testing.assert_allclose(np.array(v.forward([nxt]))[0], want, rtol=LOGIT_RTOL,
                               atol=LOGIT_ATOL)


class Garbage(Proposer):
    name = "garbage"

    def __init__(self, vocab):
        self.rng, self.vocab = np.random.default_rng(0), vocab

    def propose(self, context, k):
        return Draft(tuple(int(x) for x in self.rng.integers(-3, self.vocab + 3, k + 2)))


def run(gen):
    for ev in gen:
        if isinstance(ev, Finished):
            return list(ev.token_ids), ev.stats


@pytest.mark.slow
def test_tree_greedy_is_bit_identical_to_plain_decoding_and_prunes_useless_proposers():
    lm = load_model("tiny:5")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    plain, _ = run(speculative_generate(Verifier(lm.model), None, prompt, max_tokens=60))
    group = ProposerGroup([make_proposer("ngram", lm), make_proposer("draft:tiny:5", lm),
                           make_proposer("layerskip:2", lm), Garbage(lm.vocab_size)])
    out, st = run(tree_generate(Verifier(lm.model), group, prompt, max_tokens=60))
    assert out == plain
    assert st.acceptance_of("draft:tiny:5") == 1.0
    assert st.acceptance_of("garbage") < 0.2
    assert group.controllers[3].next_k() <= 2  # pruned (or a probe)


@pytest.mark.slow
def test_tree_greedy_on_the_embedded_model(monkeypatch):
    from mlx_lm.generate import generate_step
    import mlx.core as mx

    # the verify(L) table the group is seeded with: a fixed bandwidth-bound one, not the probe
    # of smollm2 (33 timed forwards, ~40% of this test's CPU, in every process that runs it:
    # a busy machine's table is not cached); the draft lengths below are fixed anyway
    monkeypatch.setattr("reference_loops.verify_costs",
                        lambda model: {L: 30.0 + 0.5 * (L - 1) for L in (1, 2, 4, 8, 16, 32)})
    lm = load_model("smollm2")
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat: red green blue, red green blue."}],
        add_generation_prompt=True)
    ref = []
    for (y, _), _ in zip(generate_step(mx.array(ids), lm.model, max_tokens=12), range(12)):
        if int(y) in lm.eos_ids:
            break
        ref.append(int(y))
    # 12 tokens: each drafter has had a draft accepted by then (measured with 16: 1 each, of
    # 14 blocks, committing tokens 7-8 and 10-11; 16 until the suite was cut). Fixed draft
    # lengths: adaptive ones follow measured times, so which drafts are tried (and whether one
    # is accepted in 12 tokens) would depend on the machine's load
    group = ProposerGroup([make_proposer("ngram", lm), make_proposer("layerskip:12", lm)],
                          draft_tokens=3)
    out, st = run(tree_generate(Verifier(lm.model), group, ids, max_tokens=12,
                                eos_ids=lm.eos_ids))
    assert out == ref and st.blocks < len(ref) and st.accepted > 0


def _first_token_counts(rule, p, qs, trials, seed=0):
    """Empirical distribution of the first committed token at a root with one candidate per q."""
    V = len(p)
    rng = np.random.default_rng(seed)
    counts = np.zeros(V)
    for _ in range(trials):
        xs = [int(rng.choice(V, p=q)) for q in qs]  # each proposer samples its own candidate
        tree = TokenTree.from_drafts(0, [[x] for x in xs], [q[None] for q in qs])
        pp = np.stack([p] * len(tree.tokens))
        path, nxt = rule(tree, pp, rng)
        counts[tree.tokens[path[0]] if path else nxt] += 1
    return counts


def _broken_rule(tree, p, rng):
    """Multi-draft sampling WITHOUT the residual update: biased towards the drafts."""
    for c in tree.candidates[0]:
        x = tree.tokens[c.node]
        if rng.random() < min(1.0, p[0][x] / c.q[x]):
            return [c.node], x
    return [], int(rng.choice(len(p[0]), p=p[0]))


def test_multi_draft_sampling_keeps_the_verifier_distribution():
    rng = np.random.default_rng(3)
    V = 6
    p = rng.dirichlet(np.ones(V))
    qs = [rng.dirichlet(np.ones(V) * 0.5), rng.dirichlet(np.ones(V) * 0.5)]
    good = _first_token_counts(accept_tree_sample, p, qs, 6000)
    stat, df = chi2(good, p)
    assert stat < chi2_critical(df), (stat, df)
    bad = _first_token_counts(_broken_rule, p, qs, 6000)
    stat_bad, df_bad = chi2(bad, p)
    assert stat_bad > chi2_critical(df_bad), "the test cannot tell a wrong rule from a right one"


class _OwnStream(ModelProposer):
    """A draft model sampling from its own rng stream: SpecInfer's multi-draft rule is lossless
    for INDEPENDENT candidates, so two drafters of one tree must not share their draws."""

    def __init__(self, model, name: str, stream: int) -> None:
        super().__init__(model, name)
        self.stream = stream

    def start(self, params=GREEDY) -> None:
        super().start(params)
        self._rng = make_rng(params, stream=self.stream)


# sampled tree generations of each whole-loop check (~15-20 ms each on a loaded 2-core box):
# enough to catch each broken rule below at POWER (their exact laws are far off: total
# variation 0.24-0.28; test_the_tree_loop_checks_have_the_power_to_catch_a_broken_rule), and a
# first token that leans a fifth of the way to the drafts' mean q (total variation 0.076) with
# chance 0.87 (1,200 samples, which it took before: 0.997)
TREE_LOOP_SAMPLES = 600


def _tree_sample(verifier, drafts, seed: int, max_tokens: int):
    """One seeded tree generation after the prompt [1], k=2 per draft model: (ids, stats)."""
    group = ProposerGroup([_OwnStream(m, f"draft{j}", 1 + j) for j, m in enumerate(drafts)],
                          draft_tokens=2)
    return run(tree_generate(verifier, group, [1], params=SamplingParams(1.0, seed=seed),
                             max_tokens=max_tokens))


def _tree_loop_joint(verifier_model, drafts, n: int, seed0: int):
    """Histogram of the first two committed tokens of n seeded tree generations (max_tokens=3:
    both tokens pass the first block's multi-draft acceptance), and the accepted and drafted
    totals of the blocks up to them (`first_two`: each generation stops there)."""
    from test_sampling_lossless import first_two

    vocab = int(verifier_model.args.vocab_size)
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    verifier = Verifier(verifier_model)
    accepted = drafted = 0
    for i in range(n):
        group = ProposerGroup([_OwnStream(m, f"draft{j}", 1 + j) for j, m in enumerate(drafts)],
                              draft_tokens=2)
        ids, acc, dr = first_two(tree_generate(verifier, group, [1], max_tokens=3,
                                               params=SamplingParams(1.0, seed=seed0 + i)))
        counts[ids[0], ids[1]] += 1
        accepted, drafted = accepted + acc, drafted + dr
    return counts, accepted, drafted


@pytest.mark.slow  # TREE_LOOP_SAMPLES sampled tree generations (1-layer models)
def test_tree_sampling_loop_keeps_the_verifier_distribution_and_is_seeded():
    """The whole tree loop (two draft models with probabilities, so every node runs the
    multi-draft ratio test and its residual updates) commits its first two tokens with the
    verifier's exact joint p(t1) p(t2 | t1); a seed fixes the output."""
    from engine_testkit import chi2_test
    from test_sampling_lossless import exact_joint

    from macfleet.engine.tiny import build_tiny_model

    target_model = build_tiny_model(1, 8, layers=1, weight_scale=1.0)
    drafts = [build_tiny_model(s, 8, layers=1, weight_scale=1.0) for s in (3, 4)]
    counts, accepted, drafted = _tree_loop_joint(target_model, drafts, TREE_LOOP_SAMPLES,
                                                 seed0=20_000)
    stat, df, crit = chi2_test(counts, exact_joint(target_model))
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"
    # the drafts were verified and often, not always, accepted: the rules above really ran
    assert 0.2 * drafted < accepted < 0.8 * drafted, (accepted, drafted)
    # seeded: the same seed twice gives the same tokens, another seed other tokens
    v = Verifier(target_model)
    a = _tree_sample(v, drafts, 7, 30)[0]
    assert a == _tree_sample(v, drafts, 7, 30)[0] and len(a) == 30
    assert a != _tree_sample(v, drafts, 8, 30)[0]


def test_the_tree_loop_checks_have_the_power_to_catch_a_broken_rule():
    """The chance (`chi2_power`) that each tree-loop check above rejects a broken rule's exact
    joint with TREE_LOOP_SAMPLES samples: the two-draft loop without the residual update (each
    candidate kept with min(1, p/q), else p: `_broken_rule`), and the exact-match loop keeping
    its first branch's token with chance p(x), else sampling p. Only the first token's law is
    broken here (the second is the verifier's p(t2 | t1)): the loops' second tokens pass the
    same rule, so a real break moves them too."""
    from engine_testkit import chi2_power
    from test_sampling_lossless import POWER, exact_joint, next_probs

    from macfleet.engine.tiny import build_tiny_model

    target_model = build_tiny_model(1, 8, layers=1, weight_scale=1.0)
    joint = exact_joint(target_model)
    p1 = joint.sum(axis=1)
    given_t1 = joint / p1[:, None]
    q1, q2 = (next_probs(build_tiny_model(s, 8, layers=1, weight_scale=1.0), [1])
              for s in (3, 4))
    keep1, keep2 = np.minimum(1.0, p1 / q1), np.minimum(1.0, p1 / q2)
    no_residual = q1 * keep1 + (q1 * (1 - keep1)).sum() * (
        q2 * keep2 + (q2 * (1 - keep2)).sum() * p1)  # the candidates are drawn independently
    a = int(np.argmax(p1))
    kept_with_p = np.eye(8)[a] * p1[a] + (1 - p1[a]) * p1
    for law in (no_residual, kept_with_p):
        assert 0.5 * np.abs(law - p1).sum() > 0.2  # (a break, not a rounding)
        assert chi2_power(joint, law[:, None] * given_t1, TREE_LOOP_SAMPLES) >= POWER


class _FixedChain(Proposer):
    """Drafts without probabilities (like the answer store or n-gram): the same tokens."""

    def __init__(self, tokens, name: str) -> None:
        self.tokens, self.name = tuple(tokens), name

    def propose(self, context, k):
        return Draft(self.tokens[:k])


def test_device_tree_sampling_walks_the_drawn_children():
    """Near-deterministic rows: the device outcome follows the child whose token each node
    draws, stops where no child has it, and reports the deepest node and the drawn token."""
    import mlx.core as mx

    from macfleet.engine.pipeline import sampled_tree_outcome

    t = TokenTree.from_drafts(9, [[1, 2, 3], [1, 4], [5]])  # nodes 1,2,3 | 4 under 1 | 5
    V = 10

    def rows(*want):
        x = np.full((len(want), V), -60.0, dtype=np.float32)
        x[np.arange(len(want)), want] = 0.0
        return mx.array(x)

    hot = SamplingParams(1.0, seed=3)
    out = lambda lg: sampled_tree_outcome(lg, t.tokens, t.parents, t.depths, hot, 3, 0).tolist()
    # root draws 1 -> node 1; node 1 draws 4 -> node 4; node 4 draws 7 (no child): commit 7
    assert out(rows(1, 4, 0, 0, 7, 0)) == [4, 7]
    assert out(rows(1, 2, 3, 8, 0, 0)) == [3, 8]  # the whole first chain, then a bonus
    assert out(rows(5, 0, 0, 0, 0, 6)) == [5, 6]
    assert out(rows(7, 2, 3, 0, 0, 0)) == [0, 7]  # the root's draw has no child: nothing kept


@pytest.mark.slow  # TREE_LOOP_SAMPLES sampled tree generations (1-layer models)
def test_device_tree_exact_match_sampling_keeps_the_verifier_joint():
    """Trees of drafts without probabilities (the default drafter's kind) are accepted on the
    device: the first two committed tokens follow the verifier's exact p(t1) p(t2 | t1)."""
    from engine_testkit import chi2_test
    from test_sampling_lossless import exact_joint, first_two

    from macfleet.engine.tiny import build_tiny_model

    target_model = build_tiny_model(1, 8, layers=1, weight_scale=1.0)
    joint = exact_joint(target_model)
    first = np.argsort(-joint.sum(axis=1))
    a, b = int(first[0]), int(first[1])
    second = int(np.argmax(joint[a]))
    verifier = Verifier(target_model)
    counts = np.zeros((8, 8), dtype=np.int64)
    accepted = 0
    for i in range(TREE_LOOP_SAMPLES):
        group = ProposerGroup([_FixedChain([a, second], "x"), _FixedChain([b, a], "y")],
                              draft_tokens=2)
        ids, acc, _ = first_two(tree_generate(verifier, group, [1], max_tokens=3,
                                              params=SamplingParams(1.0, seed=30_000 + i)))
        counts[ids[0], ids[1]] += 1
        accepted += acc
    stat, df, crit = chi2_test(counts, joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"
    assert accepted > TREE_LOOP_SAMPLES // 4  # the drafted branches were really walked


@pytest.mark.slow
def test_eagle_in_a_tree_reads_the_tree_forward_features(tmp_path):
    """Tree verification runs the layers itself; it must still hand the kept rows to a
    hidden-state drafter, or the drafter would recompute every feature (fallback)."""
    import mlx.core as mx

    from macfleet.distill.heads import config_for_verifier, save_head
    from macfleet.engine.proposers.eagle.head import EagleHead
    from macfleet.engine.proposers.eagle.load import make_eagle_proposer

    lm = load_model("tiny:9")
    mx.random.seed(1)
    path = save_head(EagleHead(config_for_verifier(lm.model, "tiny:9", feature_scale=1.0),
                               lm.model), tmp_path / "head")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    plain, _ = run(speculative_generate(Verifier(lm.model), None, prompt, max_tokens=40))
    eagle = make_eagle_proposer(str(path), lm)
    group = ProposerGroup([eagle, make_proposer("ngram", lm)], draft_tokens=2)
    out, _ = run(tree_generate(Verifier(lm.model), group, prompt, max_tokens=40))
    assert out == plain
    assert eagle.fallback_tokens == 0


def test_first_n_nodes_of_a_tree_are_a_tree():
    """A block cut to n tokens keeps nodes 0..n-1: children, candidates, paths and ownership
    shrink with it, and greedy acceptance walks only what is left."""
    t = TokenTree.from_drafts(9, [[1, 2, 3], [1, 4], [5]])  # nodes: 1,2,3 | 4 under 1 | 5
    assert t.tokens == [9, 1, 2, 3, 4, 5]
    c = t.first(4)
    assert c.tokens == [9, 1, 2, 3] and c.parents == [-1, 0, 1, 2]
    assert c.children[1] == {2: 2} and c.paths == [[1, 2, 3], [1], []]
    assert c.owned == [{1, 2, 3}, {1}, set()] and c.size == 3
    assert accept_tree_greedy(c, [1, 4, 3, 7])[0] == [1]  # node 4 (token 4) was cut
    assert accept_tree_greedy(t, [1, 4, 3, 7, 8, 0])[0] == [1, 4]
    assert t.first(6) is t
    with pytest.raises(ValueError):
        t.first(0)


# -- what mutation testing of tree.py found untested (issue 36) ----------------------------

def test_tree_drafts_merge_with_chains_paths_per_leaf_and_candidates_with_their_rows():
    #  draft 0, a tree:  5 (0) -> 6 (1) -> 7 (2);  8 (3) -> 9 (4);  5 (0) -> 10 (5)
    #  draft 1, a chain: 5 -> 6 -> 11
    q = np.eye(12)[[5, 6, 11]]
    t = TokenTree.from_drafts(0, [[5, 6, 7, 8, 9, 10], [5, 6, 11]], [None, q],
                              [[-1, 0, 1, -1, 3, 0], None])
    assert t.tokens == [0, 5, 6, 7, 8, 9, 10, 11]
    assert t.parents == [-1, 0, 1, 2, 0, 4, 1, 2]
    assert t.depths == [0, 1, 2, 3, 1, 2, 2, 3]
    assert t.paths == [[1, 2, 3], [4, 5], [1, 6], [1, 2, 7]]  # one per leaf, then the chain
    assert t.owned == [{1, 2, 3, 4, 5, 6}, {1, 2, 7}]
    assert t.candidates[0] == [Candidate(1, 0), Candidate(4, 0), Candidate(1, 1)]
    assert t.candidates[2] == [Candidate(3, 0), Candidate(7, 1)]
    assert t.candidates[0][0].q is None and np.array_equal(t.candidates[0][2].q, q[0])
    assert np.array_equal(t.candidates[2][1].q, q[2])
    assert ancestor_mask(t.parents).dtype == bool


def test_the_first_node_of_a_tree_is_the_root_alone_and_candidates_are_cut_too():
    t = TokenTree.from_drafts(9, [[1, 2, 3], [1, 4], [5]])
    c = t.first(4)
    assert c.candidates == [[Candidate(1, 0), Candidate(1, 1)], [Candidate(2, 0)],
                            [Candidate(3, 0)], []]
    r = t.first(1)
    assert (r.tokens, r.parents, r.depths, r.children) == ([9], [-1], [0], [{}])
    assert r.candidates == [[]] and r.paths == [[], [], []] and r.owned == [set()] * 3
    with pytest.raises(ValueError, match="^a tree keeps at least its root$"):
        t.first(0)


def test_depths_and_the_longest_branch_of_a_draft_tree():
    from macfleet.engine.tree import depths_of, longest_branch

    par = [-1, 0, 1, -1, 3, 0]
    assert depths_of(par) == [0, 1, 2, 0, 1, 1]
    assert longest_branch(par) == [0, 1, 2]
    assert longest_branch([-1, -1, 1, 0]) == [1, 2]  # the first of the deepest
    assert longest_branch([-1, 0, 1]) == [0, 1, 2]  # a chain: all of it
    assert longest_branch([-1]) == [0] and longest_branch([]) == []


def test_specinfer_at_its_boundaries():
    """One candidate x = 2 drafted with q: kept iff u < p(x) / q(x) (u in [0, 1)), and only
    when q(x) > 0; on rejection the next token comes from the residual, from the draw after."""
    q = np.array([0.25, 0.25, 0.5])
    tree = TokenTree.from_drafts(0, [[2]], [q[None]])
    like = np.array([[0.2, 0.2, 0.6]] * 2)  # p(x) / q(x) = 1.2: kept on any draw
    assert accept_tree_sample(tree, like, Draws(0.1, 0.5)) == ([1], 2)
    assert accept_tree_sample(tree, like, Draws(0.9, 0.5)) == ([1], 2)
    none = np.array([[0.5, 0.5, 0.0]] * 2)  # p(x) = 0: rejected even on u = 0.0
    assert accept_tree_sample(tree, none, Draws(0.0, 0.6)) == ([], 1)  # residual (.5, .5, 0)
    q0 = np.array([0.5, 0.5, 0.0])  # the draft's own q gave x no mass: rejected
    tree0 = TokenTree.from_drafts(0, [[2]], [q0[None]])
    assert accept_tree_sample(tree0, like, Draws(0.0, 0.5)) == ([], 2)


def test_tree_sampling_without_probabilities_follows_the_drawn_child():
    tree = TokenTree.from_drafts(0, [[2, 1]])
    p = np.eye(3)[[2, 1, 0]]  # the root draws 2, node 1 draws 1, node 2 draws 0
    assert accept_tree_sample(tree, p, np.random.default_rng(0)) == ([1, 2], 0)
    p = np.eye(3)[[1, 1, 0]]  # the root draws 1: no such child, 1 is committed
    assert accept_tree_sample(tree, p, np.random.default_rng(0)) == ([], 1)
