"""The two steps of an mlx-lm llama-family forward that macfleet runs piecewise (layer-skip
drafting, the draft head, tree verification and pipeline shards each run part of a model).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask


def run_layers(layers: Sequence[nn.Module], h: mx.array, cache=None) -> mx.array:
    """h [B, L, H] through `layers` with their caches (causal mask from the first cache)."""
    cache = cache or [None] * len(layers)
    mask = create_attention_mask(h, cache[0])
    for layer, c in zip(layers, cache):
        h = layer(h, mask, cache=c)
    return h


def head_logits(model: nn.Module, h: mx.array) -> mx.array:
    """The model's final norm and LM head (tied to the embedding, or its own) on hidden h."""
    n = model.model.norm(h)
    if hasattr(model, "lm_head") and not getattr(model.args, "tie_word_embeddings", False):
        return model.lm_head(n)
    return model.model.embed_tokens.as_linear(n)
