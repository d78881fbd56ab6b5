"""Shipping a prompt's KV (engine/kvship.py): slices, codecs, assembly checks, installation."""

from __future__ import annotations

import numpy as np
import pytest

from macfleet.engine.kvship import (KVAssembler, KVShipError, KVSlice, decode_int8,
                                    encode_int8, export_slices, install, layout_of, model_layout)
from macfleet.engine.verifier import Verifier


def _prefilled(lm, ids):
    v = Verifier(lm.model)
    v.prefill(ids)
    return v


def _ship(lm, ids, codec, max_bytes=1 << 20):
    """What a prefill agent sends, chunk by chunk, assembled as the verifier does."""
    src = Verifier(lm.model)
    asm = KVAssembler(model_layout(lm.model), len(ids))
    for start in range(0, len(ids), 512):
        src.prefill(ids[start:start + 512])
        for s in export_slices(src.cache, start, src.offset, codec, max_bytes):
            asm.add(s)
    return asm


def _ids(lm, n, seed=0):
    return np.random.default_rng(seed).integers(0, lm.vocab_size, n).tolist()


def test_layout_and_bytes(tiny):
    lay = model_layout(tiny.model)
    v = _prefilled(tiny, _ids(tiny, 10))
    assert layout_of(v.cache) == lay
    assert lay.bytes_per_token("int8") == 2 * lay.layers * lay.heads * (lay.head_dim + 2)
    assert lay.bytes_per_token("float16") * 2 == lay.bytes_per_token("auto")  # a float32 cache


def test_installed_cache_equals_computed_bitwise(tiny):
    ids = _ids(tiny, 700, seed=3)
    asm = _ship(tiny, ids, "auto")
    local = _prefilled(tiny, ids)
    v = Verifier(tiny.model)
    install(v.cache, asm.layout, asm.arrays())  # installed, not computed
    assert len(local.cache) == len(v.cache)
    for a, b in zip(local.cache, v.cache):
        assert a.offset == b.offset == len(ids)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.shape == y.shape and x.dtype == y.dtype  # allocated as a local prefill
            assert np.array_equal(np.array(x[..., :a.offset, :]), np.array(y[..., :b.offset, :]))


def test_int8_round_trip_bound(tiny):
    x = np.random.default_rng(1).normal(size=(3, 4, 50, 64)).astype(np.float32) * 5
    q, s = encode_int8(x)
    assert q.dtype == np.int8 and s.shape == x.shape[:-1] and s.dtype == np.float16
    err = np.abs(decode_int8(q, s) - x)
    # half a quantisation step per row, plus float16 rounding of the scale
    bound = np.abs(x).max(axis=-1, keepdims=True) / 127 * (0.5 + 127 * 2 ** -11) + 1e-7
    assert np.all(err <= bound)
    # and a whole shipped cache through int8 stays within that bound of the exact one
    ids = _ids(tiny, 600, seed=2)
    exact = _ship(tiny, ids, "auto").arrays()
    approx = _ship(tiny, ids, "int8").arrays()
    for (k, v), (k8, v8) in zip(exact, approx):
        for a, b in ((k, k8), (v, v8)):
            row = np.abs(a).max(axis=-1, keepdims=True) / 127
            assert np.all(np.abs(a - b) <= row * (0.5 + 127 * 2 ** -11) + 1e-6)


def test_int8_edges_zero_rows_and_tiny_rows():
    """An all-zero row encodes as zeros with a scale of 1 (no 0/0 on the way); a row so small
    that its float16 scale rounds DOWN (subnormal: max/127 = 2.0e-7 -> 1.79e-7) would need
    |q| ~ 142, and is clipped to the symmetric int8 range [-127, 127], never wrapped around."""
    x = np.array([[0.0, 0.0, 0.0, 0.0], [2.54e-5, -2.54e-5, 1e-5, 0.0]], dtype=np.float32)
    with np.errstate(divide="raise", invalid="raise"):  # (float16 underflow is expected)
        q, s = encode_int8(x)
        back = decode_int8(q, s)
    assert q[0].tolist() == [0, 0, 0, 0] and s[0] == np.float16(1.0) and not back[0].any()
    assert q[1, 0] == 127 and q[1, 1] == -127 and int(q.min()) >= -127
    assert np.array_equal(np.sign(back[1]), np.sign(x[1]))
    assert back.dtype == np.float32


def test_install_refuses_another_depth(tiny):
    ids = _ids(tiny, 8)
    asm = _ship(tiny, ids, "auto")
    v = Verifier(tiny.model)
    with pytest.raises(KVShipError) as e:
        install(v.cache, asm.layout, asm.arrays()[:-1])
    n = len(v.cache)
    assert str(e.value) == f"{n - 1} layers received, the model has {n}"


def test_int8_and_float16_sizes(tiny):
    ids = _ids(tiny, 100)
    auto, f16, i8 = (_ship(tiny, ids, c).nbytes for c in ("auto", "float16", "int8"))
    lay = model_layout(tiny.model)
    assert auto == 100 * lay.bytes_per_token("auto")
    assert f16 * 2 == auto
    assert i8 == 100 * lay.bytes_per_token("int8")


def test_assembler_refuses_gaps_overlaps_and_wrong_shapes(tiny):
    lay = model_layout(tiny.model)
    asm = KVAssembler(lay, 8)
    k = np.zeros((1, lay.heads, 4, lay.head_dim), np.float32)
    asm.add(KVSlice(0, 0, k, k))
    with pytest.raises(KVShipError, match="overlaps"):
        asm.add(KVSlice(0, 2, k, k))
    with pytest.raises(KVShipError, match="out of range"):
        asm.add(KVSlice(lay.layers, 0, k, k))
    with pytest.raises(KVShipError, match="heads"):
        asm.add(KVSlice(1, 0, k[:, :, :, :1], k[:, :, :, :1]))
    with pytest.raises(KVShipError, match="scales"):
        asm.add(KVSlice(1, 0, k.astype(np.int8), k.astype(np.int8)))
    with pytest.raises(KVShipError) as e:  # runs past the prompt's end
        asm.add(KVSlice(1, 6, k, k))
    assert str(e.value) == "slice layers 1+1 at 6+4 out of range"
    for kk, vv in ((k, k[:, :, :3]), (k[0], k[0])):  # K and V differ; not [layers, H, T, D]
        with pytest.raises(KVShipError, match="differ"):
            asm.add(KVSlice(1, 0, kk, vv))
    assert not asm.complete
    with pytest.raises(KVShipError, match="never arrived"):
        asm.arrays()


@pytest.mark.parametrize("prompt_len", [300, 700])  # a row of the shared store | its own store
def test_shipped_kv_joins_the_batch_with_identical_greedy_ids(tiny, prompt_len):
    """A prefill agent's KV installed in a batch row: the session decodes beside another one
    and gives the ids it gives when the batch prefills it ("greedy margin": two code paths)."""
    from macfleet.engine.events import Finished as Done
    from macfleet.engine.sampling import GREEDY
    from macfleet.serve.engine import BatchEngine, EngineRequest

    ids, short = _ids(tiny, prompt_len, seed=3), _ids(tiny, 12, seed=4)
    asm = _ship(tiny, ids[:-1], "auto", max_bytes=50_000)

    def run(kv):
        eng, out = BatchEngine(tiny, proposer="ngram"), {}
        for name, prompt, k in (("short", short, None), ("long", ids, kv)):
            eng.submit(EngineRequest(tuple(prompt), GREEDY, 24),
                       lambda ev, n=name: isinstance(ev, Done) and out.__setitem__(n, ev),
                       shipped_kv=k)
        eng.run_until_idle()
        return {n: e.token_ids for n, e in out.items()}, eng.history

    shipped, hist = run(asm.arrays())
    computed, _ = run(None)
    assert shipped == computed and len(shipped["long"]) == 24
    assert sum(it.prefill_tokens for it in hist) == len(short) - 1  # the long prompt: none


@pytest.mark.parametrize("prompt_len", [300, 700])  # a row of the shared store | its own store
def test_a_shipped_kv_goes_in_a_layer_per_iteration_while_others_decode(tiny, prompt_len):
    """With a tiny install share, each iteration copies one layer of the shipped KV and the
    decoding session keeps committing tokens meanwhile; the long session joins the forward
    only once every layer is in, and its ids are those of an all-at-once install."""
    from macfleet.engine.events import Finished as Done
    from macfleet.engine.events import TokensCommitted
    from macfleet.engine.sampling import GREEDY
    from macfleet.serve.engine import BatchEngine, EngineRequest

    ids, short = _ids(tiny, prompt_len, seed=5), _ids(tiny, 12, seed=6)
    kv = _ship(tiny, ids[:-1], "auto").arrays()
    layers = len(kv)
    out, short_tokens = {}, []

    def emit(name):
        def f(ev):
            if isinstance(ev, Done):
                out[name] = ev.token_ids
            elif isinstance(ev, TokensCommitted) and name == "short":
                short_tokens.append(len(ev.tokens))
        return f

    eng = BatchEngine(tiny, proposer="none", install_share=1e-9)
    eng.submit(EngineRequest(tuple(short), GREEDY, 40), emit("short"))
    eng.step()  # the short prompt is prefilled; it decodes from here on
    long = eng.submit(EngineRequest(tuple(ids), GREEDY, 16), emit("long"), shipped_kv=kv)
    for i in range(1, layers + 1):
        before = len(short_tokens)
        eng.step()
        assert long._s.kv_handle.installed == i
        assert (long._s.cache.offset == 0) == (i < layers)  # not in the forward before
        assert len(short_tokens) == before + 1  # the short session went on decoding
    eng.run_until_idle()
    at_once = BatchEngine(tiny, proposer="none", install_share=0.0)
    ref = {}
    at_once.submit(EngineRequest(tuple(ids), GREEDY, 16),
                   lambda ev: isinstance(ev, Done) and ref.__setitem__("long", ev.token_ids),
                   shipped_kv=kv)
    at_once.run_until_idle()
    assert out["long"] == ref["long"] and len(ref["long"]) == 16


# --- issue 36: what the mutants of kvship.py that survived the tests above showed --------------


def test_slices_hold_as_many_whole_layers_as_max_bytes_allows(tiny):
    """Each slice holds max_bytes // (bytes of one layer over the range) layers, at least one;
    whatever the cut, the slices carry the same K, V and scales. Checked for a range not
    starting at 0 and for int8's own price per token."""
    src = _prefilled(tiny, _ids(tiny, 24))
    lay = layout_of(src.cache)
    assert lay.layers == 4
    start, end = 5, 21
    for codec in ("auto", "int8"):
        per_layer = (end - start) * lay.bytes_per_token(codec) // lay.layers
        (one,) = export_slices(src.cache, start, end, codec, 4 * per_layer)
        for max_bytes, layers in [(1, [0, 1, 2, 3]), (per_layer - 1, [0, 1, 2, 3]),
                                  (per_layer, [0, 1, 2, 3]), (2 * per_layer, [0, 2]),
                                  (3 * per_layer, [0, 3]), (4 * per_layer, [0])]:
            got = list(export_slices(src.cache, start, end, codec, max_bytes))
            assert [s.layer for s in got] == layers, (codec, max_bytes)
            assert all(s.start == start and s.keys.shape[2] == end - start for s in got)
            if max_bytes >= per_layer:
                assert all(s.nbytes <= max_bytes for s in got)
            for field in ("keys", "values", "keys_scale", "values_scale"):
                parts = [getattr(s, field) for s in got]
                whole = getattr(one, field)
                assert (whole is None and parts == [None] * len(got)) or np.array_equal(
                    np.concatenate(parts), whole)


def test_export_refuses_a_range_outside_the_cache_and_an_unknown_codec(tiny):
    src = _prefilled(tiny, _ids(tiny, 10))
    assert [s.keys.shape[2] for s in export_slices(src.cache, 4, 4)] == [0]  # empty is a range
    for start, end in ((-1, 3), (5, 4), (0, 11)):
        with pytest.raises(KVShipError) as e:
            list(export_slices(src.cache, start, end))
        assert str(e.value) == f"positions {start}..{end} outside the cache's 10"
    with pytest.raises(KVShipError) as e:
        list(export_slices(src.cache, 0, 10, "zstd"))
    assert str(e.value) == "unknown KV codec 'zstd' (use auto, float16, int8)"


def test_a_bfloat16_cache_ships_exactly_as_float32(tiny):
    import mlx.core as mx

    src = _prefilled(tiny, _ids(tiny, 12))
    for c in src.cache:
        c.keys, c.values = c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16)
    lay = layout_of(src.cache)
    assert lay.dtype == "bfloat16" and lay.bytes_per_token("auto") == lay.bytes_per_token(
        "float16") * 2
    (s,) = export_slices(src.cache, 0, 12)
    assert s.keys.dtype == np.float32 and s.values.dtype == np.float32
    want = np.stack([np.array(c.keys[0, :, :12, :].astype(mx.float32)) for c in src.cache])
    assert np.array_equal(s.keys, want) and not np.array_equal(s.keys, s.values)
    (q,) = export_slices(src.cache, 0, 12, "int8")
    assert q.keys.dtype == np.int8 and q.keys_scale.shape == want.shape[:3]


def test_assembler_checks_int8_scales_and_reports_what_is_missing(tiny):
    lay = model_layout(tiny.model)
    asm = KVAssembler(lay, 8)
    q = np.zeros((1, lay.heads, 4, lay.head_dim), np.int8)
    s = np.ones((1, lay.heads, 4), np.float16)
    for ks, vs in ((s, s[:, :, :3]), (s[:, :, :3], s), (s, None), (None, s)):
        with pytest.raises(KVShipError) as e:
            asm.add(KVSlice(0, 0, q, q, ks, vs))
        assert str(e.value) == "int8 slices need scales of shape [layers, heads, tokens]"
    with pytest.raises(KVShipError, match="scales"):  # float slices carry no scales
        asm.add(KVSlice(0, 0, q.astype(np.float32), q.astype(np.float32), s, s))
    with pytest.raises(KVShipError) as e:
        asm.add(KVSlice(0, 0, q.astype(np.float64), q.astype(np.float64)))
    assert str(e.value) == "slice dtype float64 is not a KV codec's"
    sent = [KVSlice(0, 0, q, q, s, s)]
    asm.add(sent[0])
    with pytest.raises(KVShipError) as e:
        asm.arrays()
    assert str(e.value) == f"{lay.layers * 8 - 4} (layer, position) entries never arrived"
    sent.append(KVSlice(0, 4, q, q, s, s))
    for layer in range(1, lay.layers):
        sent.append(KVSlice(layer, 0, q[:, :, :1].repeat(8, 2), q[:, :, :1].repeat(8, 2),
                            s[:, :, :1].repeat(8, 2), s[:, :, :1].repeat(8, 2)))
    for piece in sent[1:]:
        asm.add(piece)
    assert asm.complete and asm.nbytes == sum(piece.nbytes for piece in sent)
    assert all(k.dtype == v.dtype == np.float32 for k, v in asm.arrays())


def test_a_layout_reads_heads_head_dim_and_dtype_and_prices_each_codec(tiny):
    """The layout helpers (issue 36's run of their 42 mutants): what layout_of reads off a
    cache, its refusal of an empty one, and the wire price per token of every codec for every
    cache dtype (a float16 cache ships as itself under auto; bfloat16 as float32)."""
    from mlx_lm.models.cache import make_prompt_cache

    from macfleet.engine.kvship import KV_CODECS, KVLayout

    from macfleet.engine.tiny import build_tiny_model

    lay = model_layout(tiny.model)  # the tiny llama: 4 layers, 2 kv heads of 64 / 4
    assert lay == KVLayout(4, 2, 16, "float32")
    assert model_layout(build_tiny_model(3, 64, layers=1)) == KVLayout(1, 2, 16, "float32")
    with pytest.raises(KVShipError) as e:
        layout_of(make_prompt_cache(tiny.model))
    assert str(e.value) == "the cache is empty"
    L, H, D = 3, 2, 8
    per_row = {"float32": {"auto": 4 * D, "float16": 2 * D, "int8": D + 2},
               "float16": {"auto": 2 * D, "float16": 2 * D, "int8": D + 2},
               "bfloat16": {"auto": 4 * D, "float16": 2 * D, "int8": D + 2}}
    for dtype, want in per_row.items():
        got = {c: KVLayout(L, H, D, dtype).bytes_per_token(c) for c in KV_CODECS}
        assert got == {c: 2 * L * H * n for c, n in want.items()}, dtype
