"""Where a flat batch's sessions keep their keys and values: one row each of one store.

As one mlx-lm `KVCache` per session, a batch's attention was a loop of ~18 small ops per session
per layer, each a dispatch, costing as much as the dense layers. So every session's cache is one
row of a `BatchKV` (one buffer per layer): an iteration writes with one scatter per layer, a
rollback moves the row's offset, and rows can copy another's prefix, keep a verified tree's
path, or take a KV computed elsewhere (flow KV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

DEFAULT_KV_STEP = 256  # capacity grows in steps of this many positions (mlx-lm's KVCache step)
ROW_STEP = 4  # rows grow in steps of this many sessions

# a prompt's KV computed elsewhere (a prefill agent's: flow KV; a prompt cache's entry): per
# layer (keys, values) [kv_heads, positions, head_dim]
ShippedKV = Sequence[tuple[np.ndarray | mx.array, np.ndarray | mx.array]]


@dataclass(frozen=True)
class Fetched:
    """Some rows' positions read out lazily with an iteration's outputs (`BatchKV.fetch`), so
    `keep_paths` moves a verified path without reading the buffers."""

    entry: dict[tuple[int, int], int]  # (row, position) -> its index among the fetched
    heads: int
    layers: tuple[tuple[mx.array, mx.array], ...]  # per layer (keys, values) [n * heads, hd]

    def arrays(self) -> list[mx.array]:
        return [a for kv in self.layers for a in kv]


class BatchKV:
    """Every session's KV cache as one row of one buffer per layer.

    keys[i], values[i]: [rows, kv_heads, capacity, head_dim], allocated at the first write (the
    shape comes from the model's own k/v) and grown by `ROW_STEP` rows / `step` positions when a
    session needs more; dropped when the last row closes."""

    def __init__(self, n_layers: int, step: int = DEFAULT_KV_STEP,
                 row_step: int = ROW_STEP) -> None:
        """row_step: rows added at a time (1 for a store of one long prompt's own)."""
        self.n_layers, self.step, self.row_step = n_layers, step, row_step
        self.keys: list[mx.array | None] = [None] * n_layers
        self.values: list[mx.array | None] = [None] * n_layers
        self.rows = 0  # rows the buffers have (or will have at the next write)
        self.capacity = 0  # positions per row
        self._open: set[int] = set()

    def open(self) -> RowCache:
        """A new, empty row (the lowest free one, so the batched attention spans few rows)."""
        row = next(r for r in range(len(self._open) + 1) if r not in self._open)
        self._open.add(row)
        return RowCache(self, row)

    def close(self, row: int) -> None:
        self._open.discard(row)
        if not self._open:  # idle: give the memory back
            self.keys = [None] * self.n_layers
            self.values = [None] * self.n_layers
            self.rows = self.capacity = 0

    @property
    def open_rows(self) -> int:
        return len(self._open)

    def reserve(self, rows: int, positions: int) -> None:
        """Make room for rows [0, rows) and positions [0, positions) (at each layer's write)."""
        if rows > self.rows:
            self.rows = -(-rows // self.row_step) * self.row_step
        if positions > self.capacity:
            self.capacity = -(-positions // self.step) * self.step

    def _buffers(self, i: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Layer i's buffers at the reserved size; k, v: [*, kv_heads, *, head_dim] (the
        shape and dtype of a buffer not allocated yet)."""
        out = []
        for buf, new in ((self.keys[i], k), (self.values[i], v)):
            if buf is None:
                buf = mx.zeros((self.rows, new.shape[1], self.capacity, new.shape[3]), new.dtype)
            else:
                r, h, c, d = buf.shape
                if c < self.capacity:
                    buf = mx.concatenate([buf, mx.zeros((r, h, self.capacity - c, d), buf.dtype)],
                                         axis=2)
                if r < self.rows:
                    buf = mx.concatenate(
                        [buf, mx.zeros((self.rows - r, h, self.capacity, d), buf.dtype)], axis=0)
            out.append(buf)
        return out[0], out[1]

    def copy_prefixes(self, copies: Sequence[tuple[RowCache, RowCache, int]]) -> None:
        """For each (src, dst, n): dst's cache becomes src's first n positions (a shared prompt
        prefix: one gather and one scatter per layer instead of a prefill of n tokens)."""
        for src, dst, n in copies:
            if not 0 < n <= src.offset or src.store is not self or dst.store is not self:
                raise ValueError(f"cannot share {n} positions of a row holding {src.offset}")
            self.reserve(max(src.row, dst.row) + 1, n)
        pos = np.concatenate([np.arange(n) for *_, n in copies])
        for i in range(self.n_layers):
            self.keys[i], self.values[i] = self._buffers(i, self.keys[i], self.values[i])
        self._move(np.concatenate([np.full(n, src.row) for src, _, n in copies]), pos,
                   np.concatenate([np.full(n, dst.row) for _, dst, n in copies]), pos)
        for _, dst, n in copies:
            dst.offset = n

    def _move(self, src_rows: np.ndarray, src_pos: np.ndarray, dst_rows: np.ndarray,
              dst_pos: np.ndarray) -> None:
        """Every layer's keys/values at (src_rows, src_pos) copied to (dst_rows, dst_pos): one
        gather and one scatter per layer, the gather evaluated first so the scatter runs in
        place (else MLX copies every buffer)."""
        heads = self.keys[0].shape[1]
        src_slots = self.slot_index(src_rows, src_pos, heads)
        parts = [[b.reshape(-1, b.shape[3])[src_slots] for b in (self.keys[i], self.values[i])]
                 for i in range(self.n_layers)]
        mx.eval(parts, self.state)
        dst_slots = self.slot_index(dst_rows, dst_pos, heads)
        for i, (pk, pv) in enumerate(parts):
            self._scatter(i, pk, pv, dst_slots)

    def fetch(self, spans: Sequence[tuple[RowCache, int, int]]) -> Fetched:
        """Every layer's keys/values at positions start .. start + n - 1 of each (cache,
        start, n)'s row, lazy: one gather per layer (the caller evaluates `arrays()`)."""
        rows = np.concatenate([np.full(n, c.row) for c, _, n in spans])
        pos = np.concatenate([start + np.arange(n) for _, start, n in spans])
        heads = self.keys[0].shape[1]
        slots = self.slot_index(rows, pos, heads)
        layers = tuple((k.reshape(-1, k.shape[3])[slots], v.reshape(-1, v.shape[3])[slots])
                       for k, v in zip(self.keys, self.values))
        return Fetched({(int(r), int(p)): j for j, (r, p) in enumerate(zip(rows, pos))},
                       heads, layers)

    def keep_paths(self, kept: Sequence[tuple[RowCache, int, Sequence[int]]],
                   fetched: Fetched | None = None) -> None:
        """After verifying token trees: for each (cache, base, path), the row keeps the root
        (slot base) and the accepted nodes (slots base + node) moved right behind it, and drops
        the rest. fetched: the nodes read out with the forward (`fetch`), so the moves wait for
        nothing; None: gathered here (one evaluation)."""
        for c, base, path in kept:
            if c.store is not self or base + 1 + len(path) > c.offset:
                raise ValueError(f"row {c.row}: cannot keep {len(path)} nodes past {base}")
        moves = [(c, base, list(path)) for c, base, path in kept
                 if list(path) != list(range(1, len(path) + 1))]
        if moves:
            rows = np.concatenate([np.full(len(p), c.row) for c, _, p in moves])
            src = np.concatenate([base + np.array(p) for _, base, p in moves])
            dst = np.concatenate([base + 1 + np.arange(len(p)) for _, base, p in moves])
            if fetched is None:
                self._move(rows, src, rows, dst)
                mx.eval(self.state)
            else:
                h = fetched.heads
                idx = np.array([fetched.entry[(int(r), int(p))] for r, p in zip(rows, src)])
                sel = mx.array((idx[:, None] * h + np.arange(h)).reshape(-1), dtype=mx.int32)
                dst_slots = self.slot_index(rows, dst, h)
                for i, (k, v) in enumerate(fetched.layers):
                    self._scatter(i, k[sel], v[sel], dst_slots)
        for c, base, path in kept:
            c.offset = base + 1 + len(path)

    def install(self, cache: RowCache, shipped_kv: ShippedKV, dtype: mx.Dtype,
                layers: range | None = None) -> None:
        """An empty row takes a shipped prompt KV (flow KV): per layer (keys, values)
        [kv_heads, n, head_dim] at positions 0..n-1 (an unallocated store of one row takes them
        as its buffers: one copy, no scatter). layers: only these (a long copy spread over
        iterations); the row's offset is set once the last layer is in."""
        if len(shipped_kv) != self.n_layers:
            raise ValueError(f"{len(shipped_kv)} layers of KV for a model of {self.n_layers}")
        if cache.store is not self or cache.offset:
            raise ValueError("a shipped KV goes into an empty row of this store")
        layers = range(self.n_layers) if layers is None else layers
        if not 0 <= layers.start <= layers.stop <= self.n_layers:
            raise ValueError(f"layers {layers} out of 0..{self.n_layers}")
        heads, n, _ = shipped_kv[0][0].shape
        self.reserve(cache.row + 1, n)
        slots = None
        for i in layers:
            k, v = shipped_kv[i]
            ka, va = (mx.array(a).astype(dtype) for a in (k, v))  # [heads, n, d]
            if self.keys[i] is None and self.rows == 1:
                pad = ((0, 0), (0, 0), (0, self.capacity - n), (0, 0))
                self.keys[i], self.values[i] = mx.pad(ka[None], pad), mx.pad(va[None], pad)
            else:
                if slots is None:
                    slots = self.slot_index(np.full(n, cache.row), np.arange(n), heads)
                self.keys[i], self.values[i] = self._buffers(i, ka[None], va[None])
                # one row per (position, head): the order of `slot_index`
                rk, rv = (a.transpose(1, 0, 2).reshape(-1, a.shape[2]) for a in (ka, va))
                self._scatter(i, rk, rv, slots)
            mx.eval(self.keys[i], self.values[i])
        if layers.stop == self.n_layers:
            cache.offset = n

    def _scatter(self, i: int, k: mx.array, v: mx.array, slots: mx.array) -> None:
        """Layer i's buffers (allocated, reserved size) with rows k, v [n, head_dim] written at
        flat `slots` [n]; our references are dropped first so the scatter works in place."""
        kb, vb = self.keys[i], self.values[i]
        self.keys[i] = self.values[i] = None
        kshape, vshape = kb.shape, vb.shape
        kf, vf = kb.reshape(-1, kshape[3]), vb.reshape(-1, vshape[3])
        del kb, vb
        kf[slots] = k
        vf[slots] = v
        self.keys[i], self.values[i] = kf.reshape(kshape), vf.reshape(vshape)

    def write(self, i: int, k: mx.array, v: mx.array, slots: mx.array
              ) -> tuple[mx.array, mx.array]:
        """Scatter k, v [N, kv_heads, 1, head_dim] into layer i at flat `slots` [N * kv_heads]
        (see `slot_index`); returns the updated buffers."""
        self.keys[i], self.values[i] = self._buffers(i, k, v)
        self._scatter(i, k.reshape(-1, k.shape[3]), v.reshape(-1, v.shape[3]), slots)
        return self.keys[i], self.values[i]

    def slot_index(self, rows: np.ndarray, positions: np.ndarray, kv_heads: int) -> mx.array:
        """Flat indices [N * kv_heads] of (row, head, position) in a [rows*heads*cap] view."""
        heads = np.arange(kv_heads)[None, :]
        flat = (rows[:, None] * kv_heads + heads) * self.capacity + positions[:, None]
        return mx.array(flat.reshape(-1), dtype=mx.int32)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (*self.keys, *self.values) if a is not None]


class RowCache:
    """One session's KV cache: a row of a `BatchKV`. Rollback moves the offset (O(1))."""

    def __init__(self, store: BatchKV, row: int) -> None:
        self.store, self.row, self.offset = store, row, 0
        self._closed = False

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.store.close(self.row)


def trim_cache(cache, n: int) -> None:
    """Drop the last n positions of a session's cache (a `RowCache`, mlx-lm layer caches or
    a `Verifier`)."""
    if isinstance(cache, RowCache):
        cache.trim(n)
    elif hasattr(cache, "rollback"):
        cache.rollback(n)
    else:
        for c in cache:
            c.trim(n)
