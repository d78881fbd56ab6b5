"""Load a llama-family GGUF file into mlx-lm's llama model.

MLX's own reader (`mx.load(path, return_metadata=True)`) gives the tensors, already converted to
MLX's affine quantized layout (weight, scales, biases) for Q4_0/Q4_1/Q8_0, plus the metadata.
What this module adds:

* the model config from the `llama.*` metadata;
* bits and group size inferred per tensor (the embedding is 8-bit while the layers are 4-bit in
  the embedded model), from the packed width and the known input width;
* llama.cpp's converter permutes the rows of Q and K for its rotary layout; we undo that
  permutation so mlx-lm's default (non-traditional) rope gives correct text. A wrong layout
  still writes fluent fragments: check loaders by perplexity, not by eye;
* the head is tied to the embedding when the file has no `output.weight`;
* dense (dequantized) or quantized weights: MLX's 4-bit matmul on the Linux CPU build is several
  times slower than a dense float32 one, so Linux loads dense by default.

Norm weights stay float32: casting the model to float16 on CPU made a step 20x slower.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

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
    """Undo llama.cpp's `permute()` of Q/K rows (works on packed, scales and biases alike).

    llama.cpp reshapes each head's rows to (2, head_dim/2) and swaps them to (head_dim/2, 2);
    the inverse reads (head_dim/2, 2) and swaps back.
    """
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


def _input_width(name: str, args: llama.ModelArgs) -> int:
    return args.intermediate_size if "ffn_down" in name else args.hidden_size


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
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict[str, int]] = {}

    def put(gguf_base: str, mlx_base: str, *, permute_heads: int | None = None) -> None:
        w = tensors[gguf_base + ".weight"]
        scales = tensors.get(gguf_base + ".scales")
        biases = tensors.get(gguf_base + ".biases")
        parts = {"weight": w} if scales is None else {"weight": w, "scales": scales}
        if biases is not None:
            parts["biases"] = biases
        if permute_heads is not None:
            parts = {k: unpermute_rows(v, permute_heads) for k, v in parts.items()}
        if scales is None:
            weights[mlx_base + ".weight"] = parts["weight"].astype(mx.float32)
            return
        bits, gs = _quant_params(w, scales, _input_width(gguf_base, args))
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

    model = llama.Model(args)
    if quant:
        nn.quantize(
            model,
            class_predicate=lambda p, _m: quant.get(p, False),
        )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    log.info("loaded %s (%s, %d layers)", path.name, "quantized" if quant else "dense",
             args.num_hidden_layers)
    return GGUFModel(model=model, metadata=meta, args=args, quantized=bool(quant))
