"""The flat batch's KV store on its own (engine/batch_kv.py): rows, writes, moves, installs;
no model (tests/engine/test_batch.py runs it under real forwards)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macfleet.engine.batch_kv import BatchKV, RowCache, trim_cache

HEADS, DIM = 2, 3


def _write(store: BatchKV, c: RowCache, values: list[float]) -> None:
    """Append positions holding `values` (every head and dim the same) to c's row, layer 0."""
    n = len(values)
    pos = np.arange(c.offset, c.offset + n)
    store.reserve(c.row + 1, c.offset + n)
    k = mx.array(np.repeat(np.array(values, np.float32), HEADS * DIM).reshape(n, HEADS, 1, DIM))
    store.write(0, k, k, store.slot_index(np.full(n, c.row), pos, HEADS))
    c.offset += n


def _row(store: BatchKV, c: RowCache) -> list[float]:
    return np.array(store.keys[0][c.row, 0, :c.offset, 0]).tolist()


def test_rows_open_lowest_first_and_the_memory_goes_back_when_idle():
    store = BatchKV(1, step=4, row_step=2)
    a, b = store.open(), store.open()
    assert (a.row, b.row) == (0, 1)
    _write(store, a, [1, 2, 3, 4, 5])
    assert store.capacity == 8 and store.rows == 2  # grown in steps
    a.close()
    assert store.open().row == 0  # the lowest free row again
    b.close()
    store.close(0)
    assert store.open_rows == 0 and store.state == []


def test_a_row_keeps_its_tree_path_behind_the_root():
    store = BatchKV(1, step=8)
    c = store.open()
    _write(store, c, [10, 20])  # committed prefix
    _write(store, c, [0, 1, 2, 3, 4])  # a tree: root, then nodes 1..4
    store.keep_paths([(c, 2, [2, 4])])  # keep nodes 2 and 4 behind the root at slot 2
    assert c.offset == 5 and _row(store, c) == [10, 20, 0, 2, 4]


def test_a_prefix_copies_between_rows_and_rolls_back_in_o1():
    store = BatchKV(1, step=8)
    a, b = store.open(), store.open()
    _write(store, a, [1, 2, 3, 4])
    store.copy_prefixes([(a, b, 3)])
    assert _row(store, b) == [1, 2, 3]
    trim_cache(b, 2)
    assert b.offset == 1 and _row(store, a) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        store.copy_prefixes([(a, b, 5)])  # more than a holds


def test_an_installed_kv_lands_in_its_row_layer_by_layer():
    store = BatchKV(2, step=8)
    other = store.open()
    _write(store, other, [7])
    c = store.open()
    kv = [(np.full((HEADS, 3, DIM), v, np.float32),) * 2 for v in (5.0, 6.0)]
    store.install(c, kv, mx.float32, range(0, 1))
    assert c.offset == 0  # not all layers in yet
    store.install(c, kv, mx.float32, range(1, 2))
    assert c.offset == 3 and _row(store, c) == [5, 5, 5] and _row(store, other) == [7]
    assert np.array(store.values[1][c.row, 1, :3, 2]).tolist() == [6, 6, 6]


def test_trim_cache_rolls_back_layer_lists_too():
    class Layer:
        offset = 5

        def trim(self, n):
            self.offset -= n

    layers = [Layer(), Layer()]
    trim_cache(layers, 2)
    assert [x.offset for x in layers] == [3, 3]
