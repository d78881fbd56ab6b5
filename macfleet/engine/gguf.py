"""Load a llama-family GGUF file into mlx-lm's llama model.

MLX's own reader gives the tensors (Q4_0/Q4_1/Q8_0 already in MLX's affine layout) and the
metadata; this module adds the config, per-tensor bits and group size, undoes llama.cpp's Q/K
row permutation, ties the head when the file has none, and loads dense (dequantized float32,
the Linux default: MLX's CPU quantized matmul is slower) or quantized weights. The dense
conversion is cached, as a shortcut only (`MACFLEET_NO_MODEL_CACHE=1` turns it off). Why:
docs/engine.md, "GGUF loading".
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from macfleet.engine.cachedir import cache_root

log = logging.getLogger(__name__)

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class GGUFError(ValueError):
    """A GGUF file this loader cannot turn into a model (names the reason)."""


@dataclass(frozen=True)
class GGUFModel:
    model: nn.Module
    metadata: dict[str, Any]
    args: llama.ModelArgs
    quantized: bool


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise GGUFError(f"GGUF metadata has no '{key}'")
        return default
    v = meta[key]
    if isinstance(v, mx.array):
        return v.item()
    return v


def model_args_from_metadata(meta: dict[str, Any]) -> llama.ModelArgs:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"only llama-family GGUF files are supported (this one is '{arch}')")
    hidden = int(_scalar(meta, "llama.embedding_length"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(meta, "llama.block_count")),
        intermediate_size=int(_scalar(meta, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        rms_norm_eps=float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(
            _scalar(meta, "llama.vocab_size", 0) or len(meta.get("tokenizer.ggml.tokens", []))
        ),
        rope_theta=float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_scalar(meta, "llama.context_length", 2048)),
        tie_word_embeddings=True,  # set False below when output.weight exists
    )


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's `permute()` of Q/K rows (on packed, scales and biases alike): it
    swapped each head's rows from (2, head_dim/2) to (head_dim/2, 2)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _quant_params(packed: mx.array, scales: mx.array, in_features: int) -> tuple[int, int]:
    """Infer (bits, group_size) of one quantized tensor from its shapes and known input width."""
    bits = packed.shape[-1] * 32 // in_features
    group_size = in_features // scales.shape[-1]
    if bits not in (2, 3, 4, 5, 6, 8) or group_size * scales.shape[-1] != in_features:
        raise GGUFError(
            f"cannot infer quantization: packed {packed.shape}, scales {scales.shape}, "
            f"input width {in_features}"
        )
    return bits, group_size


# Bump when the dense conversion below changes what it produces (the cached files of the old
# conversion are then replaced, never read).
CONVERSION_VERSION = 1
NO_CACHE_ENV = "MACFLEET_NO_MODEL_CACHE"
_KEY_FIELD = "macfleet.gguf_dense"  # safetensors metadata: the key the file was written for
_STALE_TMP_S = 600.0  # a temp file this old was left by a stopped writer


def dense_cache_key(path: Path) -> tuple[str, str]:
    """(file name, key) of `path`'s converted dense weights in the cache: a new name for a
    changed GGUF, conversion or MLX; the key is written inside the file and checked on reading."""
    st = path.stat()
    where = str(path.resolve())
    key = f"{where}|{st.st_size}|{st.st_mtime_ns}|v{CONVERSION_VERSION}|mlx{mx.__version__}"
    name = (f"{hashlib.sha256(where.encode()).hexdigest()[:16]}-"
            f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors")
    return name, key


def dense_cache_path(path: Path) -> Path | None:
    """Where `path`'s converted dense weights are cached; None when caching is turned off."""
    if os.environ.get(NO_CACHE_ENV, "") not in ("", "0"):
        return None
    return cache_root() / "gguf-dense" / dense_cache_key(path)[0]


def _read_dense_cache(path: Path, model: nn.Module) -> bool:
    """Load `path`'s cached dense weights into `model`; False (a bad file removed) if none."""
    cached = dense_cache_path(path)
    if cached is None or not cached.is_file():
        return False
    try:
        weights, info = mx.load(str(cached), return_metadata=True)
        if info.get(_KEY_FIELD) != dense_cache_key(path)[1]:
            raise ValueError("written for another GGUF or conversion")
        if any(v.dtype != mx.float32 for v in weights.values()):
            raise ValueError("not float32 weights")
        model.load_weights(list(weights.items()), strict=True)  # every name, every shape
        mx.eval(model.parameters())
    except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError/ValueError/...; any
        # unreadable file is rebuilt, never a failed load
        log.warning("ignoring the cached conversion %s (%s: %s); converting %s again",
                    cached, type(e).__name__, e, path.name)
        with suppress(OSError):
            cached.unlink()
        return False
    return True


def _write_dense_cache(path: Path, weights: dict[str, mx.array]) -> None:
    """Keep `weights` (evaluated) as `path`'s cached conversion: a temp file renamed into place,
    then the same GGUF's other entries removed; a cache that cannot be written is skipped."""
    cached = dense_cache_path(path)
    if cached is None:
        return
    name, key = dense_cache_key(path)
    tmp = cached.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp.safetensors")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp), weights, metadata={_KEY_FIELD: key})
        os.replace(tmp, cached)
    except (OSError, RuntimeError, ValueError) as e:  # full disk, read-only cache
        log.info("not caching the conversion of %s (%s: %s)", path.name, type(e).__name__, e)
        with suppress(OSError):
            tmp.unlink()
        return
    prefix = name.split("-")[0]
    now = time.time()
    for other in cached.parent.iterdir():
        try:
            if other.name.startswith(prefix + "-") and other != cached:
                other.unlink()  # an older GGUF, conversion or MLX at this path
            elif (other.name.startswith(f".{prefix}-") and other.name.endswith(".tmp.safetensors")
                  and now - other.stat().st_mtime > _STALE_TMP_S):
                other.unlink()
        except OSError:
            pass


def load_gguf(path: str | Path, *, dense: bool) -> GGUFModel:
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no GGUF file at {path}")
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"MLX could not read {path}: {e}") from e
    args = model_args_from_metadata(meta)
    args.tie_word_embeddings = "output.weight" not in tensors
    model = llama.Model(args)
    if dense and _read_dense_cache(path, model):
        model.eval()
        log.info("loaded %s (dense, %d layers, cached conversion)", path.name,
                 args.num_hidden_layers)
        return GGUFModel(model=model, metadata=meta, args=args, quantized=False)
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict[str, int]] = {}

    def put(gguf_base: str, mlx_base: str, *, permute_heads: int | None = None) -> None:
        w = tensors[gguf_base + ".weight"]
        scales = tensors.get(gguf_base + ".scales")
        biases = tensors.get(gguf_base + ".biases")
        parts = {k: v for k, v in (("weight", w), ("scales", scales), ("biases", biases))
                 if v is not None}
        if permute_heads is not None:
            parts = {k: unpermute_rows(v, permute_heads) for k, v in parts.items()}
        if scales is None:
            weights[mlx_base + ".weight"] = parts["weight"].astype(mx.float32)
            return
        width = args.intermediate_size if "ffn_down" in gguf_base else args.hidden_size
        bits, gs = _quant_params(w, scales, width)
        if dense:
            weights[mlx_base + ".weight"] = mx.dequantize(
                parts["weight"], parts["scales"], parts.get("biases"), gs, bits
            ).astype(mx.float32)
        else:
            for k, v in parts.items():
                weights[f"{mlx_base}.{k}"] = v
            quant[mlx_base] = {"bits": bits, "group_size": gs}

    put("token_embd", "model.embed_tokens")
    if not args.tie_word_embeddings:
        put("output", "lm_head")
    weights["model.norm.weight"] = tensors["output_norm.weight"].astype(mx.float32)
    for i in range(args.num_hidden_layers):
        for g, m in _LAYER_MAP.items():
            base = f"blk.{i}.{g}"
            if base + ".weight" not in tensors:
                raise GGUFError(f"GGUF file lacks tensor {base}.weight")
            heads = {"attn_q": args.num_attention_heads, "attn_k": args.num_key_value_heads}.get(g)
            put(base, f"model.layers.{i}.{m}", permute_heads=heads)

    if quant:
        nn.quantize(
            model,
            class_predicate=lambda p, _m: quant.get(p, False),
        )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    if dense:
        _write_dense_cache(path, weights)
    model.eval()
    log.info("loaded %s (%s, %d layers)", path.name, "quantized" if quant else "dense",
             args.num_hidden_layers)
    return GGUFModel(model=model, metadata=meta, args=args, quantized=bool(quant))
