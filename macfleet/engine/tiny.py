"""Tiny random-weight models built in code, for fast tests (spec `tiny:<seed>[:<vocab>]`).

They are real mlx-lm llama models (same code path as the big ones), just small, so every loop,
cache and acceptance test runs in milliseconds. Weights are scaled up so the output
distributions are peaked rather than uniform, which makes acceptance tests meaningful.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import llama

DEFAULT_TINY_VOCAB = 64
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?-'\n"


def tiny_args(vocab_size: int = DEFAULT_TINY_VOCAB, layers: int = 4) -> llama.ModelArgs:
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )


def build_tiny_model(seed: int, vocab_size: int = DEFAULT_TINY_VOCAB, layers: int = 4,
                     weight_scale: float = 3.0) -> nn.Module:
    mx.random.seed(seed)
    model = llama.Model(tiny_args(vocab_size, layers))
    model.update(tree_map(lambda p: p * weight_scale, model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model


class TinyTokenizer:
    """A character tokenizer for tiny models: enough for the CLI and the loop, not for language.

    Mirrors the parts of mlx-lm's TokenizerWrapper that macfleet uses.
    """

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
