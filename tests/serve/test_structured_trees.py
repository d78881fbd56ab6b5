"""Structured output with token trees (issue 32): a constrained session keeps its tree, cut to
the grammar node by node (engine/constraint.py `constrained_tree`), and every node's verify row
is masked after its own path (`tree_masks`), in one process (`tree_generate`) and in the
serving engine (serve/drafting.py, serve/decode.py).

Invariants checked on real models: greedy constrained output with a tree drafter equals
constrained plain decoding (and batched equals alone); seeded sampling equals constrained plain
sampling (exact-match acceptance draws one number per output position); trees are really
verified (a branching tree, more than the forced tokens accepted), where the old code dropped
them to chains of forced tokens. JSON (json_object, json_schema) on the embedded smollm2 with
retrieval+ngram trees (slow).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from engine_parts_kit import serve_all

import reference_loops as tree_loop
from macfleet.engine.constraint import (JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, Constraint,
                                        Grammar, constrained_tree, schema_text)
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.tree import TokenTree
from macfleet.serve.engine import BatchEngine, EngineRequest

PATTERN = r"id: [a-z]{2,6}; n [0-9]{1,3}\."  # "id: " and "; n " are forced literals
WORDS = r"([a-z]{1,6} ){3}[0-9]{1,3}!"
TREES = "ngram+draft:tiny:1:64"  # two drafters that disagree: branching trees


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny:1:64")


def _leaves(tree: TokenTree, tok) -> list[str]:
    return sorted(tok.decode(tree.path_tokens(p)) for p in tree.paths)


def _branches(tree: TokenTree) -> bool:
    """Whether some node has two children or more (a tree, not a chain)."""
    return any(len(ch) > 1 for ch in tree.children)


# -- the cut and the masks, pure ------------------------------------------------------------
def test_tree_cut_drops_exactly_the_grammar_breaking_branches(tiny):
    tok, vocab = tiny.tokenizer, tiny.vocab_size
    c = Constraint(Grammar(REGEX, PATTERN), tok, vocab)
    e = tok.encode
    drafts = [e("id: ab; n 4"), e("id: c9x"), e("ix: ab")]
    probs = [np.full((len(d), vocab), 1.0 / vocab) for d in drafts]
    tree = TokenTree.from_drafts(7, drafts, probs)
    cut = constrained_tree(c, tree, room=20)
    # '9' (no letter) goes with its subtree 'x'; 'ix' leaves the forced "id: " at 'x'
    assert _leaves(cut, tok) == ["id: ab; n 4", "id: c"]
    assert cut.tokens[1:5] == e("id: ")  # the forced chain first
    assert cut.size == len("id: ab; n 4") + 1
    assert all(x.q is None for cands in cut.candidates for x in cands)  # exact match
    assert [len(o) for o in cut.owned] == [11, 5, 1]  # drafters keep what they drafted
    assert cut.accepted_per_source([1, 2, 3, 4, 5]) == [5, 4, 1]
    assert _leaves(constrained_tree(c, tree, room=6), tok) == ["id: ab", "id: c"]
    assert _leaves(constrained_tree(c, TokenTree.from_drafts(7, []), 20), tok) == ["id: "]
    assert constrained_tree(c, tree, room=0).size == 0

    # a drafter's own tree (parents), past the forced literal: a-b-;  a-7  q-;
    assert c.commit(e("id: ")) is None
    toks = e("ab;7q;")
    own = TokenTree.from_drafts(7, [toks], None, [[-1, 0, 1, 0, -1, 4]])
    kept = constrained_tree(c, own, room=20)
    assert _leaves(kept, tok) == ["ab;", "q"]  # '7' and the ';' after one letter go
    assert kept.first(3).size == 2 and kept.first(3).paths  # a cut tree is a tree


def test_tree_masks_are_each_paths_chain_masks_and_leave_the_state(tiny):
    tok, vocab = tiny.tokenizer, tiny.vocab_size
    c = Constraint(Grammar(REGEX, WORDS), tok, vocab)
    e = tok.encode
    tree = TokenTree.from_drafts(7, [e("ab c"), e("a9"), e("b "), e("abc d")])
    m = c.tree_masks(tree.tokens, tree.parents)
    assert m.shape == (len(tree.tokens), vocab)
    ok = c.tree_accepts(tree.tokens, tree.parents)
    for node in range(1, len(tree.tokens)):
        path = [node]
        while tree.parents[path[0]] > 0:
            path.insert(0, tree.parents[path[0]])
        if ok[node]:
            assert (m[node] == c.masks(tree.path_tokens(path))[-1]).all()
        else:  # '9' after a letter: never reached by a masked walk; its row the end row
            assert tok.decode(tree.path_tokens(path)) == "a9"
            assert set(np.flatnonzero(m[node])) <= c.eos
    assert (m[0] == c.masks([])[0]).all()
    assert sum(ok) == len(tree.tokens) - 1
    assert c.cut(e("ab cd ef 1!")) == 11 and not c.done  # the state is where it was


# -- one process: tree_generate under a grammar ---------------------------------------------
def _local(lm, prompt, spec, grammar, params=GREEDY, max_tokens=40):
    from macfleet.engine.text import TextDelta
    from reference_loops import generate_local

    out = list(generate_local(lm, prompt, chat=False, proposer=spec, draft_tokens=4,
                              max_tokens=max_tokens, params=params, grammar=grammar))
    fin = out[-1]
    assert isinstance(fin, Finished)
    assert "".join(e.text for e in out if isinstance(e, TextDelta)) == \
        lm.tokenizer.decode(fin.token_ids)
    return list(fin.token_ids), fin.stats, [e for e in out if isinstance(e, BlockDone)]


@pytest.fixture
def verified_trees(monkeypatch):
    """The trees tree_generate verifies (none when a grammar drops the group)."""
    seen: list[TokenTree] = []
    real = tree_loop._verify

    def spy(verifier, tree, *a, **kw):
        seen.append(tree)
        return real(verifier, tree, *a, **kw)

    monkeypatch.setattr(tree_loop, "_verify", spy)
    return seen


GRAMMARS = [Grammar(REGEX, PATTERN), Grammar(REGEX, WORDS),
            Grammar(LARK, 'start: "ok " WORD " " WORD "."\nWORD: /[a-f]{1,5}/')]


# the reference loops (tests/reference_loops.py) under a grammar: the default suite's; the fast
# lane keeps the serving engine's trees under a grammar (below), the product's one path
@pytest.mark.slow
def test_one_process_trees_under_a_grammar_equal_constrained_plain(tiny, verified_trees):
    # each grammar and each prompt once (all nine pairs each failed the missing tree mask
    # alike; only WORDS's answers branch, on every prompt)
    prompts = ["some prompt here", "ab ab ab ab ab ab", "id: xy; n 1. id: xy; n 1. id:"]
    for grammar, p in zip(GRAMMARS, prompts):
        plain, st0, _ = _local(tiny, p, "none", grammar)
        treed, st1, blocks = _local(tiny, p, TREES, grammar)
        assert treed == plain, p
        assert st1.finish_reason == st0.finish_reason == "stop"
        assert "+" in st1.proposer  # the old code dropped the group: proposer none
        assert st1.accepted >= st0.accepted
    assert any(_branches(t) for t in verified_trees)  # trees, not chains, were verified
    # the drafters' tokens past the forced ones were accepted somewhere
    assert any(t.size > 0 for t in verified_trees)


@pytest.mark.slow  # the reference loops, as above
def test_one_process_without_tree_attention_each_branch_is_masked(tiny, verified_trees,
                                                                  monkeypatch):
    """A model without llama-style attention verifies each branch as a chain
    (`verify_branches`): its rows are masked per node too, and greedy ids are unchanged."""
    monkeypatch.setattr(tree_loop, "supports_tree_attention", lambda model: False)
    for p in ["some prompt here", "ab ab ab ab ab ab"]:
        plain, _, _ = _local(tiny, p, "none", GRAMMARS[1])
        treed, st, _ = _local(tiny, p, TREES, GRAMMARS[1])
        assert treed == plain and st.finish_reason == "stop" and "+" in st.proposer
    assert any(_branches(t) for t in verified_trees)


@pytest.mark.slow
def test_one_process_seeded_tree_sampling_equals_constrained_plain_sampling(tiny,
                                                                           verified_trees):
    g = Grammar(REGEX, PATTERN)
    for seed in range(3):
        params = SamplingParams(1.5, 1.0, seed=seed)
        plain, _, _ = _local(tiny, "some prompt here", "none", g, params)
        treed, st, _ = _local(tiny, "some prompt here", TREES, g, params)
        assert re.fullmatch(PATTERN, tiny.tokenizer.decode(treed))
        assert treed == plain and st.finish_reason == "stop"
    assert verified_trees


# -- the serving engine (serve --local's) ---------------------------------------------------
def _spy_trees(engine: BatchEngine) -> list[TokenTree | None]:
    """Every constrained session's block after drafting (None: a chain)."""
    seen: list[TokenTree | None] = []
    real = engine.drafting.draft_all

    def spy(decoding, ks):
        real(decoding, ks)
        seen.extend(s.block.tree for s in decoding if s.constraint is not None)

    engine.drafting.draft_all = spy
    return seen


def _prompts(vocab: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(7)
    rep = tuple(rng.integers(0, vocab, 5).tolist()) * 5
    return [rep, tuple(rng.integers(0, vocab, 30).tolist()), rep[:13],
            tuple(rng.integers(0, vocab, 8).tolist())]


@pytest.mark.slow
def test_serving_engine_keeps_constrained_trees_and_equals_constrained_plain(tiny):
    grammars = [Grammar(REGEX, PATTERN), Grammar(REGEX, WORDS), None, Grammar(REGEX, PATTERN)]
    reqs = [EngineRequest(p, GREEDY, 40, grammar=g)
            for p, g in zip(_prompts(tiny.vocab_size), grammars)]
    plain = [serve_all(BatchEngine(tiny, proposer="none"), [r])[0] for r in reqs]
    alone_engines = [BatchEngine(tiny, proposer=TREES, draft_tokens=4) for _ in reqs]
    seen = [_spy_trees(e) for e in alone_engines]
    alone = [serve_all(e, [r])[0] for e, r in zip(alone_engines, reqs)]
    batched = serve_all(BatchEngine(tiny, proposer=TREES, draft_tokens=4, max_active=8), reqs)
    for r, (t0, f0), (t1, f1), (t2, _) in zip(reqs, plain, alone, batched):
        assert t0 == t1 == t2
        if r.grammar is not None:
            assert f1.stats.finish_reason == "stop"
            assert f1.stats.accepted >= f0.stats.accepted
    trees = [t for ts in seen for t in ts]
    assert trees and all(t is not None for t in trees)  # the old code: chains (None)
    assert any(_branches(t) for t in trees)


@pytest.mark.slow
def test_serving_engine_seeded_tree_sampling_equals_constrained_plain_sampling(tiny):
    hot = [SamplingParams(1.5, 1.0, seed=s) for s in range(4)]
    reqs = [EngineRequest(p, h, 40, grammar=Grammar(REGEX, PATTERN))
            for p, h in zip(_prompts(tiny.vocab_size), hot)]
    engine = BatchEngine(tiny, proposer=TREES, draft_tokens=3, max_active=8)
    seen = _spy_trees(engine)
    out = serve_all(engine, reqs)
    plain = [serve_all(BatchEngine(tiny, proposer="none"), [r])[0] for r in reqs]
    for (toks, f), (t0, _) in zip(out, plain):
        assert re.fullmatch(PATTERN, tiny.tokenizer.decode(toks)), tiny.tokenizer.decode(toks)
        assert f.stats.finish_reason == "stop" and toks == t0
    assert any(t is not None and _branches(t) for t in seen)


# -- JSON on the embedded smollm2 -----------------------------------------------------------
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "enum": ["Paris", "London", "Rome"]}}}


@pytest.mark.slow  # smollm2 on the CPU: two JSON answers, plain / serving engine
def test_json_on_smollm2_with_retrieval_trees_equals_constrained_plain(monkeypatch):
    """Both answers, plain and with trees, as one batch (greedy batched equals alone on smollm2:
    test_batch.py::test_smollm2_batched_greedy_equals_alone; under a JSON grammar:
    test_structured.py's test_json_schema_on_smollm2_...), trees of at most 4 drafted tokens
    (the default budget's trees cost this test 3x the verify time for the same property).
    The reference loop (tests/reference_loops.py, test code) was asked the same here too, each
    answer alone; its trees under a grammar are the tiny model's
    test_one_process_trees_under_a_grammar_equal_constrained_plain (docs/testing.md, ninth
    round)."""
    import macfleet.engine.verify_costs as vc

    jsonschema = pytest.importorskip("jsonschema")
    lm = load_model("smollm2")
    # a fixed verify(L) table of a bandwidth-bound verifier, as on a machine that measured it
    # once (test_auto_drafting's smollm2 test): its probe was a third of this test's CPU, and
    # greedy ids do not depend on the table
    monkeypatch.setattr(vc, "_memo", {})
    vc._remember(lm.model, {L: 10.0 + 0.2 * (L - 1) for L in (1, 2, 4, 8, 16, 32, 64)})
    tok = lm.tokenizer
    cases = [(Grammar(JSON_SCHEMA, schema_text(PERSON)),
              "Give me a record for Bob, 41, from Rome.", 60),
             (Grammar(JSON_OBJECT), "Give the capital of France as JSON with the key capital.",
              40)]
    spec, k = "retrieval+ngram", 4
    reqs = [EngineRequest(tuple(tok.apply_chat_template([{"role": "user", "content": q}],
                                                       add_generation_prompt=True)),
                          GREEDY, n, frozenset(tok.eos_token_ids), grammar=g)
            for g, q, n in cases]
    # plain decoding and the trees as ONE batch of four sessions (they were two batches: on
    # the CPU a forward of four sessions costs about one of two, so the trees' forwards went):
    # an engine of no drafter, each tree session given its own group
    from macfleet.serve.drafting import make_drafting

    engine = BatchEngine(lm, proposer="none", draft_tokens=k, max_active=2 * len(reqs))
    seen: list[TokenTree | None] = []  # the tree sessions' blocks after drafting
    real = engine.drafting.draft_all

    def spy(decoding, ks):
        real(decoding, ks)
        seen.extend(s.block.tree for s in decoding if s.group is not None)

    engine.drafting.draft_all = spy
    out: list[list] = [[] for _ in range(2 * len(reqs))]
    for i, r in enumerate(reqs):
        engine.submit(r, out[2 * i].append)
        engine.submit(r, out[2 * i + 1].append, proposer=make_drafting(spec, lm, k, False))
    engine.run_until_idle()
    got = [([t for e in evs if isinstance(e, TokensCommitted) for t in e.tokens],
            next(e for e in evs if isinstance(e, Finished))) for evs in out]
    plain, served = got[0::2], got[1::2]
    assert seen and all(t is not None for t in seen)
    for (g, q, n), (p, f0), (t, f1) in zip(cases, plain, served):
        assert t == p, (tok.decode(p), tok.decode(t))
        assert "+" in f1.stats.proposer
        if f0.stats.finish_reason == "stop":
            obj = json.loads(tok.decode(p))
            if g.kind == JSON_SCHEMA:
                jsonschema.validate(obj, PERSON)
        assert f1.stats.accepted >= f0.stats.accepted
