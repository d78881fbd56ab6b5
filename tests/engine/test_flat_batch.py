"""The flat batch's decisions and plumbing on their own (engine/batch.py): which segments attend
together and in which store, the refusals, each segment's hidden rows and logits across two
stores, and a draft head's layers over a flat batch. Written for the mutants of batch.py that
the batched-equals-alone tests let survive (issue 36, docs/testing.md)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tolerance import LOGIT_ATOL, LOGIT_RTOL

from macfleet.engine.batch import (BATCHED_CONTEXT_SLACK, MAX_BATCHED_SEGMENT, BatchKV,
                                   Segment, batched_segments, flat_forward, flat_layers,
                                   main_store)
from macfleet.engine.layers import head_logits
from macfleet.engine.tree_verify import supports_tree_attention
from macfleet.engine.verifier import Verifier, make_trimmable_cache


def _rows(store: BatchKV, offsets) -> list:
    rows = [store.open() for _ in offsets]
    for r, o in zip(rows, offsets):
        r.offset = o
    return rows


def test_decode_blocks_of_the_main_store_attend_together_unless_their_context_is_far_longer():
    main, other = BatchKV(1), BatchKV(1)
    a, b, c, d, e = _rows(main, [10, 20, 30, 40, 0])
    (f,) = _rows(other, [5])
    segs = [Segment((1, 2), a), Segment((1,) * MAX_BATCHED_SEGMENT, b),
            Segment((1,) * (MAX_BATCHED_SEGMENT + 1), c),  # too long a block
            Segment((1, 2, 3), d, None),  # a prefill chunk
            Segment((1,), f),  # another store's row
            Segment((1,), e)]
    assert main_store(segs) is main
    assert batched_segments(segs) == [True, True, False, False, False, True]
    assert batched_segments([]) == [] and batched_segments([Segment((1,), a, None)]) == [False]
    # a row whose context ends past twice the median end + the slack attends alone
    rows = _rows(BatchKV(1), [10, 20, 30, 0])
    limit = 2 * 31 + BATCHED_CONTEXT_SLACK  # the ends: 11, 21, 31 and the far one's
    for far, want in ((limit - 1, True), (limit, False)):
        rows[3].offset = far
        assert batched_segments([Segment((1,), r) for r in rows]) == [True, True, True, want]
    # the main store: the one most segments write to (a tie: the first segment's)
    x, y = _rows(other, [1, 1])
    assert main_store([Segment((1,), a), Segment((1,), x), Segment((1,), y)]) is other
    assert main_store([Segment((1,), a), Segment((1,), x)]) is main


def test_a_model_without_llama_attention_is_not_run_as_a_flat_batch(tiny):
    # (the serving engine runs it on its own forward: tests/engine/test_architectures.py)
    assert supports_tree_attention(tiny.model)

    class Odd:
        pass

    assert not supports_tree_attention(Odd())


def test_flat_batches_refuse_what_they_cannot_run(tiny):
    m = tiny.model
    store = BatchKV(len(m.layers))
    a, b = store.open(), store.open()
    for bad in ([], [Segment((), a)], [Segment((1,), a), Segment((), b)]):
        with pytest.raises(ValueError) as e:
            flat_forward(m, bad)
        assert str(e.value) == "flat_forward needs at least one segment, none of them empty"
        with pytest.raises(ValueError) as e:
            flat_layers(m.layers, mx.zeros((1, 1, 64)), bad)
        assert str(e.value) == "flat_layers needs at least one segment, none of them empty"
    with pytest.raises(ValueError) as e:
        flat_forward(m, [Segment((1,), a), Segment((2,), a)])
    assert str(e.value) == "two segments of one flat batch write the same cache row"
    with pytest.raises(ValueError) as e:
        flat_forward(m, [Segment((1,), a), Segment((2,), make_trimmable_cache(m))])
    assert str(e.value) == "a flat batch needs every segment's cache to be a BatchKV row"
    with pytest.raises(ValueError) as e:
        flat_forward(m, [Segment((1,), make_trimmable_cache(m))], hidden=True)
    assert str(e.value) == "hidden states come from the flat batch (rows of a BatchKV)"
    assert a.offset == b.offset == 0


@pytest.mark.parametrize("exact", ["0", "1"])  # engine/fastmath's attention | MLX's own
def test_hidden_rows_and_logits_follow_each_segment_across_two_stores(tiny, monkeypatch, exact):
    """Rows 0 of two stores in one forward (a long prompt's own store beside the shared one):
    each segment's logits are its own alone, from `logits_from` on, and its hidden rows are
    the ones its logits come from."""
    monkeypatch.setenv("MACFLEET_EXACT_MATH", exact)
    m = tiny.model
    rng = np.random.default_rng(11)
    prompts = [tuple(rng.integers(0, tiny.vocab_size, n).tolist()) for n in (30, 9, 14)]
    shared, own = BatchKV(len(m.layers)), BatchKV(len(m.layers), row_step=1)
    rows = [own.open(), shared.open(), shared.open()]
    out, feats = flat_forward(m, [Segment(p[:-1], r, None) for p, r in zip(prompts, rows)],
                              hidden=True)
    assert out == [None] * 3 and [f.shape for f in feats] == [(29, 64), (8, 64), (13, 64)]
    blocks = [(prompts[0][-1], 4), (prompts[1][-1],), (prompts[2][-1], 7)]  # 2: causal alone
    segs = [Segment(blocks[0], rows[0], 0), Segment(blocks[1], rows[1], 0),
            Segment(blocks[2], rows[2], 1)]
    out, feats = flat_forward(m, segs, hidden=True)
    for p, s, lg, f in zip(prompts, segs, out, feats):
        v = Verifier(m)
        v.prefill(p[:-1])
        ref = np.array(v.forward(s.tokens))[s.logits_from:]
        assert lg.shape == ref.shape and f.shape == (len(s), 64)
        np.testing.assert_allclose(np.array(lg), ref, rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
        own_logits = head_logits(m, f[None])[0].astype(mx.float32)[s.logits_from:]
        np.testing.assert_allclose(np.array(own_logits), np.array(lg), rtol=1e-5, atol=1e-5)
    assert [r.offset for r in rows] == [31, 9, 15]


def test_a_draft_heads_layers_run_a_flat_batch_in_segment_order(tiny):
    """flat_layers over the model's own layers: each segment's outputs are the hidden rows
    flat_forward gives it (a long segment attends alone, after the others: reordered)."""
    m = tiny.model
    rng = np.random.default_rng(12)
    toks = [tuple(rng.integers(0, tiny.vocab_size, n).tolist()) for n in (20, 3, 1)]
    stores = [BatchKV(len(m.layers)) for _ in range(2)]
    rows = [[st.open() for _ in toks] for st in stores]
    froms = (None, 0, 0)
    _, want = flat_forward(m, [Segment(t, r, lf) for t, r, lf in zip(toks, rows[0], froms)],
                           hidden=True)
    x = m.model.embed_tokens(mx.array([t for ts in toks for t in ts], dtype=mx.uint32)[None])
    got = flat_layers(m.layers, x, [Segment(t, r, lf) for t, r, lf in zip(toks, rows[1], froms)])
    assert [g.shape for g in got] == [(20, 64), (3, 64), (1, 64)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-6, atol=1e-6)
    assert [r.offset for r in rows[1]] == [20, 3, 1]


def test_blocks_of_one_length_in_every_row_attend_without_gathers(tiny):
    """Every row 0..R-1 holding one block of the same length (the plan's no-gather case):
    each row's logits are its session's alone."""
    m = tiny.model
    rng = np.random.default_rng(13)
    prompts = [tuple(rng.integers(0, tiny.vocab_size, n).tolist()) for n in (6, 17, 11)]
    store = BatchKV(len(m.layers))
    rows = [store.open() for _ in prompts]
    hist = [list(p[:-1]) for p in prompts]
    flat_forward(m, [Segment(tuple(h), r, None) for h, r in zip(hist, rows)])
    for blocks in ([(p[-1],) for p in prompts], [(3, 4), (5, 6), (7, 8)]):
        refs = []
        for h, b in zip(hist, blocks):
            v = Verifier(m)
            v.prefill(h)
            refs.append(np.array(v.forward(b)))
        out = flat_forward(m, [Segment(b, r) for b, r in zip(blocks, rows)])
        for lg, ref in zip(out, refs):
            np.testing.assert_allclose(np.array(lg), ref, rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
        for h, b in zip(hist, blocks):
            h.extend(b)
    assert [r.offset for r in rows] == [8, 19, 13]


def test_a_segment_attends_causally_or_to_its_ancestors():
    """A chain's own tokens see the ones before them at positions 0..L-1; a tree's see their
    ancestors, at their depths."""
    from macfleet.engine.tree import ancestor_mask

    chain = Segment((5, 6, 7), None)
    assert chain.rope_offsets() == [0, 1, 2] and chain.own_mask().dtype == bool
    assert np.array_equal(chain.own_mask(), np.tril(np.ones((3, 3), dtype=bool)))
    tree = Segment((5, 6, 7, 8), None, 0, (-1, 0, 0, 1))
    assert tree.rope_offsets() == [0, 1, 1, 2]
    assert np.array_equal(tree.own_mask(), ancestor_mask((-1, 0, 0, 1)))


def test_the_batch_invariant_mode_returns_logits_only_where_asked(tiny):
    """Per-session caches: a prefill chunk gets no logits, a block its rows from logits_from,
    as float32, the single-session forward's own bits."""
    m = tiny.model
    caches = [make_trimmable_cache(m) for _ in range(2)]
    out = flat_forward(m, [Segment((1, 2, 3), caches[0], None), Segment((4, 5, 6), caches[1], 1)])
    v = Verifier(m)
    ref = np.array(v.forward((4, 5, 6)))[1:]
    assert out[0] is None and out[1].dtype == mx.float32
    assert np.array_equal(np.array(out[1]), ref)


def test_a_one_layer_model_runs_a_flat_batch():
    from macfleet.engine.tiny import build_tiny_model

    m = build_tiny_model(3, 64, layers=1)
    store = BatchKV(1)
    a, b = store.open(), store.open()
    flat_forward(m, [Segment((1, 2, 3), a, None), Segment((4,), b, None)])
    out = flat_forward(m, [Segment((5, 6), a), Segment((7,), b)])
    for prefix, blk, lg in (((1, 2, 3), (5, 6), out[0]), ((4,), (7,), out[1])):
        v = Verifier(m)
        v.prefill(prefix)
        np.testing.assert_allclose(np.array(lg), np.array(v.forward(blk)), rtol=LOGIT_RTOL,
                                   atol=LOGIT_ATOL)


def test_a_long_tree_attends_alone_to_its_ancestors_under_mlx_attention(tiny, monkeypatch):
    """A tree of more than MAX_BATCHED_SEGMENT nodes attends alone with its boolean ancestor
    mask, under MLX's own attention too (which would add a float mask, not select with it)."""
    from macfleet.engine.tree import TokenTree, depths_of
    from macfleet.engine.tree_verify import tree_forward

    monkeypatch.setenv("MACFLEET_EXACT_MATH", "1")
    m = tiny.model
    rng = np.random.default_rng(14)
    n = MAX_BATCHED_SEGMENT + 4
    parents = (-1, *(int(rng.integers(0, i)) for i in range(1, n)))
    toks = tuple(int(t) for t in rng.integers(0, tiny.vocab_size, n))
    prompt = tuple(rng.integers(0, tiny.vocab_size, 12).tolist())
    store = BatchKV(len(m.layers))
    c = store.open()
    flat_forward(m, [Segment(prompt, c, None)])
    (out,) = flat_forward(m, [Segment(toks, c, 0, parents)])
    v = Verifier(m)
    v.prefill(prompt)
    ref = tree_forward(v, TokenTree(list(toks), list(parents), depths_of(parents), [], [], []))
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=LOGIT_RTOL, atol=LOGIT_ATOL)


def test_a_block_alone_in_a_high_row_attends_through_the_gathers(tiny):
    """One 2-token block in row 3 (rows 0-2 idle this iteration): R = 4 rows of Lq = 2 cells
    for 2 tokens, so the plan gathers; the logits are the session's alone."""
    m = tiny.model
    store = BatchKV(len(m.layers))
    rows = [store.open() for _ in range(4)]
    flat_forward(m, [Segment((1, 2, 3), r, None) for r in rows])
    (out,) = flat_forward(m, [Segment((4, 5), rows[3])])
    v = Verifier(m)
    v.prefill((1, 2, 3))
    np.testing.assert_allclose(np.array(out), np.array(v.forward((4, 5))), rtol=LOGIT_RTOL,
                               atol=LOGIT_ATOL)
