"""Tiny random-weight models built in code, for fast tests (specs `tiny:`, `tiny-6h:` and
`tiny-moe:<seed>[:<vocab>]`): real mlx-lm models (llama, qwen3_moe), just small. Weights are
scaled up so output distributions are peaked, which makes acceptance tests meaningful; the
MoE's router too, so no token's top-k experts sit near a tie a summation order could flip.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import llama, qwen3_moe

DEFAULT_TINY_VOCAB = 64
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?-'\n"


def tiny_args(vocab_size: int = DEFAULT_TINY_VOCAB, layers: int = 4, heads: int = 4,
              kv_heads: int = 2) -> llama.ModelArgs:
    """16 dimensions a head, an MLP twice as wide (`tiny-6h:`'s 6 heads, 3 kv heads and MLP
    columns divide by 3: tensor parallelism over 3 ranks)."""
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=16 * heads,
        num_hidden_layers=layers,
        intermediate_size=32 * heads,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )


def build_tiny_model(seed: int, vocab_size: int = DEFAULT_TINY_VOCAB, layers: int = 4,
                     weight_scale: float = 3.0, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    mx.random.seed(seed)
    model = llama.Model(tiny_args(vocab_size, layers, heads, kv_heads))
    model.update(tree_map(lambda p: p * weight_scale, model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model


def tiny_moe_args(vocab_size: int = DEFAULT_TINY_VOCAB, layers: int = 4) -> qwen3_moe.ModelArgs:
    """8 experts, 2 per token, every layer sparse: heads, kv heads, the experts' width and count
    divide by 2 and 4, so tensor, pipeline and expert parallelism run it over 2 and 4 ranks."""
    return qwen3_moe.ModelArgs(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,  # dense MLP width; unused while every layer is sparse
        num_attention_heads=8,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        num_key_value_heads=4,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        norm_topk_prob=True,
    )


def build_tiny_moe(seed: int, vocab_size: int = DEFAULT_TINY_VOCAB, layers: int = 4,
                   weight_scale: float = 3.0, router_scale: float = 8.0) -> nn.Module:
    """A random qwen3_moe model, deterministic from `seed`."""
    mx.random.seed(seed)
    model = qwen3_moe.Model(tiny_moe_args(vocab_size, layers))
    model.update(tree_map(lambda p: p * weight_scale, model.parameters()))
    for layer in model.model.layers:
        layer.mlp.gate.weight = layer.mlp.gate.weight * router_scale
    mx.eval(model.parameters())
    model.eval()
    return model


class TinyTokenizer:
    """A character tokenizer for tiny models (what macfleet uses of mlx-lm's TokenizerWrapper)."""

    has_chat_template = False

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids: set[int] = set()
        self.eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(_ALPHABET.find(c.lower()) % self.vocab_size) if c.lower() in _ALPHABET
                else 0 for c in text] or [0]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(_ALPHABET[i % len(_ALPHABET)] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **_kw) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))
