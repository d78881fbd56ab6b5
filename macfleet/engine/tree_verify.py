"""Verify a token tree in ONE forward of a llama-family model, then keep the accepted path.

The model's own layers and weights run with a replacement attention step: each node at
position offset + depth, attending to the cached prefix and its own ancestors; afterwards the
accepted path's cache entries move right behind the root (`compact_cache`). A model is run this
way only once its own forward and this one agree on a short probe (`supports_tree_attention`);
any other (or a sharded verifier) verifies each branch as a chain (`branch_rows`), never wrong.
Why: docs/engine.md, "Tree verification".
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from macfleet.engine import fastmath
from macfleet.engine.layers import head_logits
from macfleet.engine.tree import TokenTree, ancestor_mask, depths_of, nodes_to
from macfleet.engine.verifier import Verifier


PROBE_TOKENS = (1, 2, 3, 5, 8, 13)  # the probe's prompt (any ids in the vocabulary)
PROBE_TOLERANCE = 1e-2  # of the largest logit: kernels differ in the last bits, a wrong
#                         formula (a missing norm, another rotation) by whole units
_probed: dict[int, tuple[weakref.ref, bool]] = {}  # id(model) -> (the model, its answer)


def supports_tree_attention(model: nn.Module) -> bool:
    """Whether `tree_forward` (and engine/batch.py's flat forward) computes what the model's
    own does: llama-shaped parts, then a probe, once per model."""
    inner = getattr(model, "model", None)
    layers = getattr(model, "layers", None)
    if inner is None or not layers or not hasattr(inner, "embed_tokens"):
        return False
    a = getattr(layers[0], "self_attn", None)
    need = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
    if a is None or not all(hasattr(a, n) for n in need) or not hasattr(layers[0], "mlp"):
        return False
    seen = _probed.get(id(model))
    if seen is not None and seen[0]() is model:
        return seen[1]
    ok = _agrees_with_model(model)
    _probed[id(model)] = (weakref.ref(model), ok)
    return ok


def _agrees_with_model(model: nn.Module) -> bool:
    """The probe: the model's own forward and `tree_forward` on a chain of PROBE_TOKENS."""
    toks = [t % model.model.embed_tokens.weight.shape[0] for t in PROBE_TOKENS]
    n = len(toks)
    try:
        want = model(mx.array([toks]), cache=make_prompt_cache(model))[0].astype(mx.float32)
        chain = TokenTree(toks, [-1, *range(n - 1)], list(range(n)), [], [], [])
        got = tree_forward(Verifier(model), chain)
        gap, scale = mx.max(mx.abs(got - want)), mx.max(mx.abs(want))
        return bool(gap <= PROBE_TOLERANCE * mx.maximum(scale, 1.0))
    except Exception:  # noqa: BLE001 - any failure of this forward on this model: not ours
        return False


def head_projections(attn, x: mx.array) -> tuple[mx.array, mx.array]:
    """Queries and keys of x [1, N, D] before the rotation, [N, heads, 1, head_dim] each, each
    head's normalised where the model's attention does so (Qwen3's `q_norm`/`k_norm`)."""
    N = x.shape[1]
    q = attn.q_proj(x).reshape(N, attn.n_heads, 1, -1)
    k = attn.k_proj(x).reshape(N, attn.n_kv_heads, 1, -1)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k


def tree_attention(attn, x: mx.array, mask: mx.array, cache, positions: mx.array) -> mx.array:
    """A llama attention step for nodes of a tree: per-node rope positions, an explicit mask
    ([L, cached + L]); appends the nodes' keys/values to `cache` (the verifier's or the draft
    head's, for EAGLE-2 expansion)."""
    _, L, _ = x.shape  # x: [1, L, D]
    q, k = head_projections(attn, x)  # one batch row per node
    v = attn.v_proj(x).reshape(1, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=positions).reshape(1, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.rope(k, offset=positions).reshape(1, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    keys, values = cache.update_and_fetch(k, v)
    # fastmath's softmax on the CPU (MLX's masked attention runs a scalar exp there)
    out = fastmath.sdpa(q, keys, values, attn.scale, mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, L, -1))


def tree_forward(verifier: Verifier, tree: TokenTree, return_hidden: bool = False):
    """Logits [N+1, V] for every node, appending N+1 entries to the verifier's cache
    (with return_hidden: also the last layer's pre-norm hidden states [N+1, H])."""
    model, offset = verifier.model, verifier.offset
    positions = mx.array([offset + d for d in tree.depths], dtype=mx.int32)
    mask = mx.concatenate([mx.ones((len(tree.tokens), offset), dtype=mx.bool_),
                           mx.array(ancestor_mask(tree.parents))], axis=1)
    h = model.model.embed_tokens(mx.array(tree.tokens, dtype=mx.uint32)[None])
    for layer, c in zip(model.layers, verifier.cache):
        h = h + tree_attention(layer.self_attn, layer.input_layernorm(h), mask, c, positions)
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


def trees_in_cache(verifier: Verifier) -> bool:
    """Whether `verifier` verifies a token tree in ONE forward in its own cache (a sharded
    verifier, without one here, is never probed); else branch by branch."""
    return hasattr(verifier, "cache") and supports_tree_attention(verifier.model)


def tree_rows(verifier: Verifier, tokens: Sequence[int], parents: Sequence[int]) -> mx.array:
    """Logits [N, V] (float32) of every node of a token tree (node 0 its root) on the
    verifier's own forward, in one forward or branch by branch; `keep_path` follows."""
    if trees_in_cache(verifier):
        tree = TokenTree(list(tokens), list(parents), depths_of(parents), [], [], [])
        return tree_forward(verifier, tree)
    return branch_rows(verifier, tokens, parents)


def keep_path(verifier: Verifier, tree: TokenTree, path: Sequence[int]) -> None:
    """After `tree_rows`: the cache ends with the tree's root and its accepted `path`."""
    if trees_in_cache(verifier):
        compact_cache(verifier, verifier.offset - len(tree.tokens), path)
    else:  # refill the accepted entries
        verifier.forward([tree.tokens[0], *tree.path_tokens(path)])


def branch_rows(verifier: Verifier, tokens: Sequence[int], parents: Sequence[int]) -> mx.array:
    """Every node's logits [N, V], each root-to-leaf branch verified as a chain (a node's row
    from the first branch through it); the cache is left as it was."""
    base = verifier.offset
    rows: list[mx.array | None] = [None] * len(tokens)
    inner = set(parents)
    for leaf in [i for i in range(len(tokens)) if i not in inner] or [0]:
        chain = nodes_to(parents, leaf)
        logits = verifier.forward([tokens[0], *(tokens[i] for i in chain)])
        mx.eval(logits)
        for row, node in enumerate([0, *chain]):
            if rows[node] is None:
                rows[node] = logits[row]
        verifier.rollback(verifier.offset - base)
    return mx.stack(rows)
