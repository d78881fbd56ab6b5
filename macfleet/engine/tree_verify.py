"""Verify a token tree in ONE forward of a llama-family model, then keep the accepted path.

mlx-lm's attention applies rotary embeddings at `cache.offset + t`, i.e. positions that follow
the block order. A tree needs position `offset + depth(node)` and attention restricted to each
node's ancestors. We run the model's own layers and weights with a replacement attention step:
* rotary per node: `mx.fast.rope` accepts one offset per batch row, so the block is laid out
  as N+1 rows of length 1, each with its own position;
* mask: the cached prefix is visible to every node, tree columns only to descendants;
* the keys/values of all nodes are appended to the cache; after acceptance the accepted
  path's entries are moved right behind the root and the rest trimmed (`compact_cache`).
Models whose attention does not look like llama's (q/k/v/o projections, `rope`, `n_heads`)
fall back to verifying each branch as a chain (`verify_branches`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macfleet.engine import fastmath
from macfleet.engine.layers import head_logits
from macfleet.engine.tree import TokenTree, ancestor_mask
from macfleet.engine.verifier import Verifier


def supports_tree_attention(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(model, "layers", None)
    if inner is None or not layers or not hasattr(inner, "embed_tokens"):
        return False
    a = getattr(layers[0], "self_attn", None)
    need = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
    return a is not None and all(hasattr(a, n) for n in need) and hasattr(layers[0], "mlp")


def tree_attention(attn, x: mx.array, mask: mx.array, cache, positions: mx.array) -> mx.array:
    """A llama attention step for nodes of a tree: per-node rope positions, an explicit mask
    ([L, cached + L]); appends the nodes' keys/values to `cache` (the verifier's or the draft
    head's, for EAGLE-2 expansion)."""
    _, L, _ = x.shape  # x: [1, L, D]
    q = attn.q_proj(x).reshape(L, attn.n_heads, 1, -1)  # one batch row per node
    k = attn.k_proj(x).reshape(L, attn.n_kv_heads, 1, -1)
    v = attn.v_proj(x).reshape(1, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=positions).reshape(1, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.rope(k, offset=positions).reshape(1, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    keys, values = cache.update_and_fetch(k, v)
    # MLX's masked attention runs its scalar exp on the CPU: fastmath's softmax there (logits
    # within 5e-5, the same argmax: results/fastmath.json), MLX's own kernel elsewhere
    out = fastmath.sdpa(q, keys, values, attn.scale, mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, L, -1))


def tree_forward(verifier: Verifier, tree: TokenTree, return_hidden: bool = False,
                 pad_to: int = 0):
    """Logits [N+1, V] for every node, appending N+1 entries to the verifier's cache
    (with return_hidden: also the last layer's pre-norm hidden states [N+1, H]).

    pad_to > N+1 runs the block at that length (a shape the device runs faster, or compiled
    already): extra nodes under the root that no tree node sees; their rows come back too
    (the caller reads the first N+1) and their cache entries go with `compact_cache`."""
    model = verifier.model
    inner = model.model
    offset = verifier.offset
    n = max(len(tree.tokens), pad_to)
    pad = n - len(tree.tokens)
    parents = [*tree.parents, *([0] * pad)]
    positions = mx.array([offset + d for d in [*tree.depths, *([1] * pad)]], dtype=mx.int32)
    tree_mask = mx.array(ancestor_mask(parents))
    mask = mx.concatenate([mx.ones((n, offset), dtype=mx.bool_), tree_mask], axis=1)
    toks = [*tree.tokens, *([tree.tokens[-1]] * pad)]
    h = inner.embed_tokens(mx.array(toks, dtype=mx.uint32)[None])
    for layer, c in zip(model.layers, verifier.cache):
        r = tree_attention(layer.self_attn, layer.input_layernorm(h), mask, c, positions)
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = head_logits(model, h)[0]
    if not return_hidden:
        return logits.astype(mx.float32)
    return logits.astype(mx.float32), h[0]


def compact_cache(verifier: Verifier, base: int, path: Sequence[int]) -> None:
    """Keep root (at `base`) + the accepted path nodes, contiguous; drop the other nodes."""
    m = len(path)
    if m and list(path) != list(range(1, m + 1)):
        idx = mx.array([base + i for i in path], dtype=mx.int32)
        for c in verifier.cache:
            c.keys[..., base + 1 : base + 1 + m, :] = mx.take(c.keys, idx, axis=2)
            c.values[..., base + 1 : base + 1 + m, :] = mx.take(c.values, idx, axis=2)
    verifier.rollback(verifier.offset - (base + 1 + m))


def verify_branches(verifier: Verifier, tree: TokenTree,
                    masks: np.ndarray | None = None) -> np.ndarray:
    """Fallback for other architectures: each proposer's chain verified on its own.

    Returns argmax ids per node (greedy only): the shared root row comes from the first
    branch; every node's row is computed with exactly its ancestors in the cache.
    masks: [N+1, V] bool, the tokens allowed at each node (a grammar's); None: all.
    """
    base = verifier.offset
    ids = np.full(len(tree.tokens), -1, dtype=np.int64)
    chains = tree.paths or [[]]
    for chain in chains:
        logits = verifier.forward([tree.tokens[0], *(tree.tokens[i] for i in chain)])
        if masks is not None:
            logits = mx.where(mx.array(masks[[0, *chain]]), logits, float("-inf"))
        am = np.array(mx.argmax(logits, axis=-1))
        for row, node in enumerate([0, *chain]):
            ids[node] = am[row]
        verifier.rollback(verifier.offset - base)
    return ids
