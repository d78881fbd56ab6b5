"""One forward over a flat batch of many sessions' new tokens (continuous batching).

Decode is memory-bound: one forward over N tokens reads the weights once. Serving many users
therefore concatenates every active session's new tokens (a speculative block, or a prefill
chunk) into ONE sequence [1, N] and runs embeddings, the q/k/v/o projections, the MLPs and the
LM head on it; only attention is per session, against that session's own mlx-lm `KVCache`
with that session's rope offset, so every session keeps O(1) rollback (`trim`) and its own
KV length (vLLM's flat batch, without paged attention).

Row results of a dense layer do not depend on the other rows here (MLX's `x @ W.T` with
OpenBLAS gives each row the same bits whatever the batch; tests check it on real models), and
each session's attention sees exactly the shapes it would see alone, so a greedy request's
ids do not change under batching. `invariant=True` runs each segment as its own forward
(the model's own `__call__`, the single-session code path) for backends where that fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from macfleet.engine.layers import head_logits
from macfleet.engine.tree_verify import supports_tree_attention


class BatchUnsupported(ValueError):
    """The model's layers do not look like llama's: it cannot run a flat batch."""


@dataclass(frozen=True)
class Segment:
    """One session's new tokens in an iteration.

    cache: that session's per-layer KV caches (appended to in place).
    logits_from: rows >= this index get logits (a block: 0; a prefill chunk: None).
    """

    tokens: tuple[int, ...]
    cache: list
    logits_from: int | None = 0

    def __len__(self) -> int:
        return len(self.tokens)


def check_batchable(model: nn.Module) -> None:
    if not supports_tree_attention(model):
        raise BatchUnsupported(
            f"{type(model).__module__}.{type(model).__name__} has no llama-style attention "
            "(q/k/v/o projections, rope): continuous batching supports the llama family")


def _attention(attn, x: mx.array, segments: Sequence[Segment], layer: int,
               positions: mx.array) -> mx.array:
    """x: [1, N, D] flat batch -> o_proj(attention) [1, N, D].

    Projections and rotary embeddings run once on the flat batch (`mx.fast.rope` takes one
    offset per batch row, so the N tokens are laid out as N rows at their own positions);
    only the cache update and the attention itself are per segment."""
    N = x.shape[1]
    q = attn.rope(attn.q_proj(x).reshape(N, attn.n_heads, 1, -1), offset=positions)
    k = attn.rope(attn.k_proj(x).reshape(N, attn.n_kv_heads, 1, -1), offset=positions)
    v = attn.v_proj(x).reshape(N, attn.n_kv_heads, 1, -1)
    outs = []
    start = 0
    for seg in segments:
        end = start + len(seg)
        # rows [start, end) as one sequence: [L, heads, 1, hd] -> [1, heads, L, hd]
        keys, values = seg.cache[layer].update_and_fetch(k[start:end].transpose(2, 1, 0, 3),
                                                         v[start:end].transpose(2, 1, 0, 3))
        outs.append(mx.fast.scaled_dot_product_attention(
            q[start:end].transpose(2, 1, 0, 3), keys, values, scale=attn.scale,
            mask="causal" if len(seg) > 1 else None))
        start = end
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)  # [1, heads, N, hd]
    return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(1, N, -1))


def _flat(model: nn.Module, segments: Sequence[Segment]) -> list[mx.array | None]:
    inner = model.model
    toks = [int(t) for s in segments for t in s.tokens]
    positions = mx.array([s.cache[0].offset + i for s in segments for i in range(len(s))],
                         dtype=mx.int32)
    h = inner.embed_tokens(mx.array(toks, dtype=mx.uint32)[None])  # [1, N, D]
    for i, layer in enumerate(model.layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), segments, i, positions)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    rows: list[int] = []
    spans: list[tuple[int, int] | None] = []
    start = 0
    for s in segments:
        if s.logits_from is None:
            spans.append(None)
        else:
            a = len(rows)
            rows.extend(range(start + s.logits_from, start + len(s)))
            spans.append((a, len(rows)))
        start += len(s)
    if not rows:
        return [None] * len(segments)
    sel = h[:, mx.array(rows, dtype=mx.int32)] if len(rows) < start else h
    logits = head_logits(model, sel)[0].astype(mx.float32)  # [rows, V]
    return [None if sp is None else logits[sp[0]:sp[1]] for sp in spans]


def _one_by_one(model: nn.Module, segments: Sequence[Segment]) -> list[mx.array | None]:
    out: list[mx.array | None] = []
    for s in segments:
        x = mx.array([int(t) for t in s.tokens], dtype=mx.uint32)[None]
        logits = model(x, cache=s.cache)
        out.append(None if s.logits_from is None
                   else logits[0, s.logits_from:].astype(mx.float32))
    return out


def flat_forward(model: nn.Module, segments: Sequence[Segment], *,
                 invariant: bool = False) -> list[mx.array | None]:
    """Logits [len(seg) - logits_from, V] per segment (None for prefill chunks), evaluated;
    every segment's tokens are appended to its cache."""
    if not segments or any(not len(s) for s in segments):
        raise ValueError("flat_forward needs at least one segment, none of them empty")
    out = (_one_by_one if invariant else _flat)(model, segments)
    mx.eval([o for o in out if o is not None] + [c.state for s in segments for c in s.cache])
    return out
