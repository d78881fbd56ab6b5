"""One forward over a flat batch of many sessions' new tokens (continuous batching).

Decode is memory-bound, so every active session's new tokens (a speculative block, a prefill
chunk) are concatenated into ONE sequence [1, N] that reads the weights once. Each session's
cache is a row of a `BatchKV`; short segments attend together in one masked call, long ones
alone. Caches given as per-layer lists or a session's own `Verifier` run each segment as its
own forward (batch-invariant). Why, and what is not bit-identical: docs/engine.md, "Flat batch".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macfleet.engine import fastmath
from macfleet.engine.batch_kv import (DEFAULT_KV_STEP, ROW_STEP, BatchKV, RowCache,  # noqa: F401
                                      trim_cache)
from macfleet.engine.layers import head_logits
from macfleet.engine.tree import ancestor_mask, depths_of
from macfleet.engine.tree_verify import head_projections, tree_rows
from macfleet.engine.verifier import Verifier

MAX_BATCHED_SEGMENT = 16  # decode blocks up to this long share one attention call
BATCHED_CONTEXT_SLACK = 256  # ... unless their context exceeds 2x the median one by this much


@dataclass(frozen=True)
class Segment:
    """One session's new tokens in an iteration. cache: its `RowCache`, per-layer mlx-lm
    caches or own `Verifier`, appended to. logits_from: rows >= this get logits (a prefill
    chunk: None). parents: a token tree's (-1: the root; parents precede children): token i
    sits at slot offset + i, position offset + depth(i), and attends to the prefix and its
    ancestors; None: a chain. tokens may be a lazy array (flat batch only)."""

    tokens: tuple[int, ...] | mx.array
    cache: object
    logits_from: int | None = 0
    parents: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def rope_offsets(self) -> list[int]:
        """Each token's position past the cached prefix (its depth, for a tree)."""
        return list(range(len(self))) if self.parents is None else depths_of(self.parents)

    def own_mask(self) -> np.ndarray:
        """[L, L] which of the segment's own tokens each one attends to."""
        L = len(self)
        return (np.tril(np.ones((L, L), dtype=bool)) if self.parents is None
                else ancestor_mask(self.parents))


@dataclass(frozen=True)
class _Plan:
    """Index arrays of one flat iteration (short segments first), shared by every layer:
    q_index [R * Lq], the flat token of each (row, query) cell; out_index [n_short], the cell
    of each short-segment token (both None when every row is one block in row order); mask
    [R, 1, Lq, T], None when every cell sees every key (`unmasked`)."""

    n_short: int
    n_rows: int
    lq: int
    q_index: mx.array | None
    out_index: mx.array | None
    mask: mx.array | None
    t_max: int
    # (flat start, length, cache, a tree's mask [L, offset + L] or None: causal)
    long: tuple[tuple[int, int, RowCache, mx.array | None], ...]


def main_store(segments: Sequence[Segment]) -> BatchKV:
    """The store most segments' rows live in (the one whose rows attend together)."""
    stores = [s.cache.store for s in segments]
    return max(dict.fromkeys(stores), key=lambda st: sum(x is st for x in stores))


def batched_segments(segments: Sequence[Segment]) -> list[bool]:
    """Which segments attend together: decode blocks of at most `MAX_BATCHED_SEGMENT` tokens
    in `main_store` whose context is not far longer than the others' (the shared call pads
    every row to the longest block and context; the rest attend alone)."""
    main = main_store(segments) if segments else None
    cand = [s.logits_from is not None and len(s) <= MAX_BATCHED_SEGMENT
            and s.cache.store is main for s in segments]
    ends = sorted(s.cache.offset + len(s) for s, c in zip(segments, cand) if c)
    if not ends:
        return cand
    limit = 2 * ends[len(ends) // 2] + BATCHED_CONTEXT_SLACK
    return [c and s.cache.offset + len(s) <= limit for s, c in zip(segments, cand)]


def unmasked(mask: np.ndarray, exact_without: bool) -> bool:
    """Whether the batched attention may skip its mask: every cell sees every key, and
    leaving it out gives the same bits (`exact_without`: fastmath's CPU attention)."""
    return exact_without and bool(mask.all())


def _plan(segs: Sequence[Segment], n_batched: int, exact_without_mask: bool = False) -> _Plan:
    """segs: the batched segments first (n_batched of them), then those attending alone.
    exact_without_mask: a mask of all True may be left out (`unmasked`)."""
    short = segs[:n_batched]
    n_short = sum(len(s) for s in short)
    long, start = [], n_short
    for s in segs[n_batched:]:
        tree_mask = None
        if s.parents is not None:
            tree_mask = mx.array(np.concatenate(
                [np.ones((len(s), s.cache.offset), dtype=bool), s.own_mask()], axis=1))
        long.append((start, len(s), s.cache, tree_mask))
        start += len(s)
    if not short:
        return _Plan(0, 0, 0, None, None, None, 0, tuple(long))
    n_rows = max(s.cache.row for s in short) + 1
    lq = max(len(s) for s in short)
    t_max = max(s.cache.offset + len(s) for s in short)
    q_index = np.zeros((n_rows, lq), np.int32)
    out_index = np.zeros(n_short, np.int32)
    # keys a (row, query) cell may see: j <= limit; rows without a segment see key 0 only
    limit = np.zeros((n_rows, lq), np.int64)
    n = 0
    for s in short:
        r, L, off = s.cache.row, len(s), s.cache.offset
        q_index[r, :L] = np.arange(n, n + L)
        out_index[n:n + L] = r * lq + np.arange(L)
        limit[r] = off + np.minimum(np.arange(lq), L - 1)
        n += L
    mask = np.arange(t_max)[None, None, :] <= limit[:, :, None]  # [R, Lq, T]
    for s in short:  # a tree's own tokens see their ancestors only
        if s.parents is not None:
            r, L, off = s.cache.row, len(s), s.cache.offset
            own = s.own_mask()
            mask[r, :L, off:off + L] = own
            mask[r, L:, off:off + L] = own[L - 1]  # padding cells: as the last token
    m = None if unmasked(mask, exact_without_mask) else mx.array(mask[:, None])
    if n_rows * lq == n_short:  # every row one block of Lq tokens, in row order: no gathers
        return _Plan(n_short, n_rows, lq, None, None, m, t_max, tuple(long))
    return _Plan(n_short, n_rows, lq, mx.array(q_index.reshape(-1)), mx.array(out_index), m,
                 t_max, tuple(long))


def _attention(attn, x: mx.array, writes: Sequence[tuple[BatchKV, mx.array | None, mx.array]],
               layer: int, positions: mx.array, plan: _Plan) -> mx.array:
    """x: [1, N, D] flat batch -> o_proj(attention) [1, N, D]. Rope runs once with the N
    tokens as N rows at their own positions; one scatter writes every new key/value."""
    N, H = x.shape[1], attn.n_heads
    # one rope call for queries and keys (a call costs more than its arithmetic; same bits)
    qk = mx.concatenate(head_projections(attn, x), axis=1)
    qk = attn.rope(qk, offset=positions)
    q, k = qk[:, :H], qk[:, H:]  # [N, H, 1, hd], [N, kv_heads, 1, hd]
    v = attn.v_proj(x).reshape(N, attn.n_kv_heads, 1, -1)
    hd = q.shape[-1]
    kv = {}  # store -> its updated keys, values [rows, kv_heads, cap, hd]
    for store, idx, slots in writes:
        kv[store] = store.write(layer, k if idx is None else k[idx],
                                v if idx is None else v[idx], slots)
    keys, values = kv[writes[0][0]]
    outs = []
    if plan.n_short:
        R, Lq = plan.n_rows, plan.lq
        qs = q[:plan.n_short].reshape(plan.n_short, H, hd)
        if plan.q_index is not None:
            qs = qs[plan.q_index]
        qb = qs.reshape(R, Lq, H, hd).transpose(0, 2, 1, 3)
        ks, vs = keys[:R, :, :plan.t_max], values[:R, :, :plan.t_max]
        # no mask: this module's attention still (MLX's fused kernel would round otherwise)
        o = (fastmath.attention(qb, ks, vs, attn.scale, None) if plan.mask is None
             else fastmath.sdpa(qb, ks, vs, attn.scale, plan.mask))  # [R, H, Lq, hd]
        o = o.transpose(0, 2, 1, 3).reshape(R * Lq, H * hd)
        outs.append(o if plan.out_index is None else o[plan.out_index])
    for start, L, c, tree_mask in plan.long:
        row, end = c.row, c.offset + L
        ks, vs = kv[c.store]
        qs = q[start:start + L].transpose(2, 1, 0, 3)  # [1, H, L, hd]
        o = fastmath.sdpa(
            qs, ks[row:row + 1, :, :end], vs[row:row + 1, :, :end], attn.scale,
            tree_mask if tree_mask is not None else "causal" if L > 1 else None)
        outs.append(o.transpose(0, 2, 1, 3).reshape(L, H * hd))
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)  # [N, H * hd]
    return attn.o_proj(o[None])


class _Layout:
    """One flat iteration's order, writes, positions and attention plan (shared by its layers)."""

    def __init__(self, segments: Sequence[Segment], kv_heads: int) -> None:
        caches = [s.cache for s in segments]
        if not all(isinstance(c, RowCache) for c in caches):
            raise ValueError("a flat batch needs every segment's cache to be a BatchKV row")
        if len({(id(c.store), c.row) for c in caches}) < len(caches):
            raise ValueError("two segments of one flat batch write the same cache row")
        # batched segments first, by row (a full batch of one-token blocks then needs no gathers)
        batched = batched_segments(segments)
        self.order = sorted(range(len(segments)), key=lambda i: (not batched[i], caches[i].row))
        self.segs = segs = [segments[i] for i in self.order]
        rows = np.array([s.cache.row for s in segs for _ in range(len(s))], np.int64)
        pos = np.array([s.cache.offset + i for s in segs for i in range(len(s))], np.int64)
        rope = np.array([s.cache.offset + d for s in segs for d in s.rope_offsets()], np.int64)
        self.plan = _plan(segs, sum(batched), exact_without_mask=fastmath.enabled())
        # one scatter per store per layer (the main store first: its rows attend together)
        of_store = [s.cache.store for s in segs for _ in range(len(s))]
        self.writes = []
        for store in dict.fromkeys([main_store(segments), *(c.store for c in caches)]):
            mine = np.array([st is store for st in of_store])
            store.reserve(int(rows[mine].max()) + 1, int(pos[mine].max()) + 1)
            idx = None if mine.all() else mx.array(np.flatnonzero(mine), dtype=mx.int32)
            self.writes.append((store, idx, store.slot_index(rows[mine], pos[mine], kv_heads)))
        self.positions = mx.array(rope, dtype=mx.int32)

    def run(self, layers: Sequence[nn.Module], h: mx.array) -> mx.array:
        """h [1, N, D] in flat order through llama-style `layers`; every segment's cache then
        holds its tokens."""
        for i, layer in enumerate(layers):
            h = h + _attention(layer.self_attn, layer.input_layernorm(h), self.writes, i,
                               self.positions, self.plan)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for s in self.segs:
            s.cache.offset += len(s)
        return h


def flat_layers(layers: Sequence[nn.Module], x: mx.array, segments: Sequence[Segment]
                ) -> list[mx.array]:
    """Any llama-style decoder layers (a draft head's) over a flat batch: x [1, N, D] the
    segments' inputs in order (a `Segment`'s tokens only give its length); returns each
    segment's outputs [len(seg), D], not evaluated. Every segment's cache is appended to."""
    if not segments or any(not len(s) for s in segments):
        raise ValueError("flat_layers needs at least one segment, none of them empty")
    lay = _Layout(segments, layers[0].self_attn.n_kv_heads)
    starts = np.cumsum([0] + [len(s) for s in segments])
    if lay.order != sorted(lay.order):
        perm = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in lay.order])
        x = x[:, mx.array(perm, dtype=mx.int32)]
    h = lay.run(layers, x)
    out: list[mx.array | None] = [None] * len(segments)
    start = 0
    for i, s in zip(lay.order, lay.segs):
        out[i] = h[0, start:start + len(s)]
        start += len(s)
    return out


def _flat(model: nn.Module, segments: Sequence[Segment], hidden: bool = False
          ) -> list[mx.array | None] | tuple[list[mx.array | None], list[mx.array]]:
    lay = _Layout(segments, model.layers[0].self_attn.n_kv_heads)
    order, segs = lay.order, lay.segs
    if any(isinstance(s.tokens, mx.array) for s in segs):  # lazy tokens: read by the device
        ids = mx.concatenate([s.tokens.astype(mx.uint32) if isinstance(s.tokens, mx.array)
                              else mx.array(s.tokens, dtype=mx.uint32) for s in segs])
    else:
        ids = mx.array([int(t) for s in segs for t in s.tokens], dtype=mx.uint32)
    h = model.model.embed_tokens(ids[None])  # [1, N, D]
    h = lay.run(model.layers, h)
    # logits only for the rows that need them (a prefill chunk needs none)
    want: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    rows_of: dict[int, tuple[int, int]] = {}  # segment -> its rows of h
    start = 0
    for i, s in zip(order, segs):
        rows_of[i] = (start, start + len(s))
        if s.logits_from is not None:
            a = len(want)
            want.extend(range(start + s.logits_from, start + len(s)))
            spans[i] = (a, len(want))
        start += len(s)
    out: list[mx.array | None] = [None] * len(segments)
    if want:
        sel = h[:, mx.array(want, dtype=mx.int32)] if len(want) < start else h
        logits = head_logits(model, sel)[0].astype(mx.float32)  # [rows, V]
        out = [logits[spans[i][0]:spans[i][1]] if i in spans else None
               for i in range(len(segments))]
    if not hidden:
        return out
    return out, [h[0, a:b] for a, b in (rows_of[i] for i in range(len(segments)))]


def _one_by_one(model: nn.Module, segments: Sequence[Segment]) -> list[mx.array | None]:
    out: list[mx.array | None] = []
    for s in segments:
        if isinstance(s.cache, Verifier):  # its own forward (and prefill, in its own chunks)
            if s.logits_from is None:
                s.cache.prefill(s.tokens)
                out.append(None)
            elif s.parents is not None:  # a token tree (`tree_verify.keep_path` follows)
                out.append(tree_rows(s.cache, s.tokens, s.parents)[s.logits_from:])
            else:
                out.append(s.cache.forward(s.tokens)[s.logits_from:])
            continue
        x = mx.array([int(t) for t in s.tokens], dtype=mx.uint32)[None]
        logits = model(x, cache=s.cache)
        out.append(None if s.logits_from is None
                   else logits[0, s.logits_from:].astype(mx.float32))
    return out


@dataclass(frozen=True)
class FlatOutputs:
    """One iteration's forward, not evaluated: a caller builds its decisions on these and
    evaluates `pending()` in ONE `mx.eval`. logits as `flat_forward`'s; hidden: pre-norm
    last-layer states (asked for; else None); state: the caches' buffers, evaluated with
    them (the next forward writes into them in place)."""

    logits: tuple[mx.array | None, ...]
    hidden: tuple[mx.array, ...] | None
    state: tuple[mx.array, ...]

    def pending(self) -> list[mx.array]:
        """Every array the caller must evaluate (with its own) before the next forward."""
        return ([o for o in self.logits if o is not None] + list(self.state)
                + list(self.hidden or ()))


def flat_outputs(model: nn.Module, segments: Sequence[Segment], *, hidden: bool = False
                 ) -> FlatOutputs:
    """`flat_forward` left lazy: every segment's tokens are appended to its cache (offsets
    move now; the buffers' writes are part of `state`), nothing is evaluated."""
    if not segments or any(not len(s) for s in segments):
        raise ValueError("flat_forward needs at least one segment, none of them empty")
    feats = None
    if isinstance(segments[0].cache, RowCache):
        out = _flat(model, segments, hidden)
        if hidden:
            out, feats = out
            feats = tuple(feats)
        state = [a for st in dict.fromkeys(s.cache.store for s in segments) for a in st.state]
    elif hidden:
        raise ValueError("hidden states come from the flat batch (rows of a BatchKV)")
    else:
        out = _one_by_one(model, segments)
        state = [a for s in segments for c in own_caches(s.cache) for a in _flat_state(c.state)]
    return FlatOutputs(tuple(out), feats, tuple(state))


def own_caches(cache) -> Sequence:
    """A session's own per-layer caches: the list itself, or its verifier's (none here for
    a sharded one, whose caches are on its ranks)."""
    return getattr(cache, "cache", ()) if isinstance(cache, Verifier) else cache


def _flat_state(state) -> list[mx.array]:
    """An mlx-lm cache's `state` (an array, or a tuple/list of them) as a list of arrays."""
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for x in state for a in _flat_state(x)]
    return []


def flat_forward(model: nn.Module, segments: Sequence[Segment], *, hidden: bool = False
                 ) -> list[mx.array | None] | tuple[list[mx.array | None], list[mx.array]]:
    """Logits [len(seg) - logits_from, V] per segment (None for prefill chunks), evaluated;
    every segment's tokens are appended to its cache. hidden: also each segment's pre-norm
    last-layer states [len(seg), H] (flat batch only). `flat_outputs` is this left lazy."""
    f = flat_outputs(model, segments, hidden=hidden)
    mx.eval(f.pending())
    return (list(f.logits), list(f.hidden)) if hidden else list(f.logits)
