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


# --- issue 36: what the mutants of the store's rows, copies and installs showed ------------------


def test_several_prefixes_copy_in_one_call_and_bad_copies_are_refused():
    store = BatchKV(1, step=4)
    a, b, c = store.open(), store.open(), store.open()
    _write(store, a, [1, 2, 3, 4, 5])
    store.copy_prefixes([(a, b, 3), (a, c, 5)])
    assert (b.offset, c.offset) == (3, 5) and store.capacity == 8
    assert _row(store, b) == [1, 2, 3] and _row(store, c) == [1, 2, 3, 4, 5]
    other = BatchKV(1, step=4).open()
    other.offset = 3
    for bad, n in (((a, b, 0), 0), ((a, b, 6), 6), ((a, other, 2), 2), ((other, b, 2), 2)):
        with pytest.raises(ValueError) as e:
            store.copy_prefixes([bad])
        assert str(e.value) == f"cannot share {n} positions of a row holding {bad[0].offset}"
    assert b.offset == 3
    store.copy_prefixes([(a, b, 1)])  # one position is a prefix too
    assert b.offset == 1 and _row(store, b) == [1]
    lean = BatchKV(1, step=4, row_step=1)  # the copy's row is past the allocated ones
    x = lean.open()
    _write(lean, x, [1, 2])
    y = lean.open()
    lean.copy_prefixes([(x, y, 2)])
    assert lean.rows == 2 and _row(lean, y) == [1, 2]


def test_a_one_row_store_takes_a_shipped_kv_as_its_buffers():
    """A long prompt's own store (one row, not allocated yet) takes the arrays padded to its
    capacity; decoding then writes behind them."""
    store = BatchKV(2, step=8, row_step=1)
    c = store.open()
    kv = [(np.full((HEADS, 3, DIM), v, np.float32), np.full((HEADS, 3, DIM), -v, np.float32))
          for v in (5.0, 6.0)]
    store.install(c, kv, mx.float32)
    assert c.offset == 3 and (store.rows, store.capacity) == (1, 8)
    assert tuple(store.keys[1].shape) == tuple(store.values[0].shape) == (1, HEADS, 8, DIM)
    assert np.array(store.values[1][0, 1, :, 2]).tolist() == [-6.0] * 3 + [0.0] * 5
    _write(store, c, [7])
    assert _row(store, c) == [5, 5, 5, 7]
    one = BatchKV(1, step=8, row_step=1)  # a one-layer model's
    r = one.open()
    one.install(r, kv[:1], mx.float32)
    assert r.offset == 3 and _row(one, r) == [5, 5, 5]
    two = BatchKV(1, step=8, row_step=2)  # two rows, none allocated: row 1 by a scatter
    two.open()
    r = two.open()
    two.install(r, kv[:1], mx.float32)
    assert tuple(two.keys[0].shape) == (2, HEADS, 8, DIM) and _row(two, r) == [5, 5, 5]


def test_an_install_refuses_what_does_not_fit():
    store = BatchKV(2, step=8)
    c = store.open()
    kv = [(np.zeros((HEADS, 2, DIM), np.float32),) * 2] * 2
    cases = [((kv[:1], mx.float32), "1 layers of KV for a model of 2"),
             ((kv, mx.float32, range(1, 3)), "layers range(1, 3) out of 0..2"),
             ((kv, mx.float32, range(-1, 1)), "layers range(-1, 1) out of 0..2")]
    store.install(c, kv, mx.float32, range(1, 1))  # no layer: nothing to do
    assert c.offset == 0
    for args, msg in cases:
        with pytest.raises(ValueError) as e:
            store.install(c, *args)
        assert str(e.value) == msg
    for row in (BatchKV(2).open(), c):
        row.offset = 1 if row is c else 0
        with pytest.raises(ValueError) as e:
            store.install(row, kv, mx.float32)
        assert str(e.value) == "a shipped KV goes into an empty row of this store"


def test_rows_and_positions_grow_in_steps_and_keep_what_they_hold():
    store = BatchKV(1, step=4, row_step=3)
    a = store.open()
    _write(store, a, [1, 2, 3])
    assert (store.rows, store.capacity) == (3, 4)
    assert tuple(store.keys[0].shape) == (3, HEADS, 4, DIM)
    _write(store, a, [4, 5])  # past the capacity: grown by a step
    rows = [store.open() for _ in range(3)]
    _write(store, rows[2], [9])  # row 3: a step of rows more
    assert (store.rows, store.capacity) == (6, 8)
    assert tuple(store.values[0].shape) == (6, HEADS, 8, DIM)
    assert _row(store, a) == [1, 2, 3, 4, 5] and _row(store, rows[2]) == [9]
    store.reserve(2, 3)  # never shrinks
    assert (store.rows, store.capacity) == (6, 8)
    assert store.slot_index(np.array([1, 2]), np.array([3, 0]), 2).tolist() == [
        (1 * 2 + 0) * 8 + 3, (1 * 2 + 1) * 8 + 3, (2 * 2 + 0) * 8, (2 * 2 + 1) * 8]
    old = rows[0]
    old.close()
    assert store.open_rows == 3 and store.open().row == 1  # the lowest free row again
    old.close()  # a second close of the old handle frees nothing (row 1 has a new owner)
    assert store.open_rows == 4 and store.open().row == 4


def test_a_row_that_closes_leaves_the_others_their_kv():
    store = BatchKV(1, step=4)
    a, b = store.open(), store.open()
    _write(store, a, [1, 2])
    _write(store, b, [3, 4, 5])
    a.close()
    assert _row(store, b) == [3, 4, 5] and (store.rows, store.capacity) == (4, 4)
    b.close()
    assert store.state == [] and (store.rows, store.capacity) == (0, 0)  # idle: freed
    c = store.open()
    _write(store, c, [6])  # and usable again
    assert _row(store, c) == [6] and (store.rows, store.capacity) == (4, 4)


def test_a_half_precision_store_stays_in_its_dtype_as_it_grows():
    store = BatchKV(1, step=4, row_step=1)
    a = store.open()
    for n, row in ((3, a), (3, a), (1, store.open())):  # allocate, grow positions, grow rows
        k = mx.ones((n, HEADS, 1, DIM), mx.float16)
        store.reserve(row.row + 1, row.offset + n)
        store.write(0, k, k, store.slot_index(np.full(n, row.row),
                                              np.arange(row.offset, row.offset + n), HEADS))
        row.offset += n
        assert store.keys[0].dtype == store.values[0].dtype == mx.float16
    assert tuple(store.keys[0].shape) == (2, HEADS, 8, DIM)


def test_keeping_tree_paths_from_fetched_nodes_waits_for_nothing_and_moves_in_place(
        monkeypatch):
    """With the tree nodes fetched (and evaluated) with the forward, keep_paths runs no
    mx.eval (the serving engine's iteration keeps one synchronisation; the next forward's
    evaluation carries the moves), yet every buffer is updated in place and right. A gather
    from the buffers left lazy beside its scatter made MLX copy every layer's buffers."""
    layers, rows, cap = 2, 4, 2048
    store = BatchKV(layers)
    caches = [store.open() for _ in range(rows)]
    store.reserve(rows, cap)
    slots = store.slot_index(np.repeat(np.arange(rows), cap), np.tile(np.arange(cap), rows),
                             HEADS)
    for i in range(layers):
        k = mx.random.normal((rows * cap, HEADS, 1, DIM), key=mx.random.key(i))
        store.write(i, k, -k, slots)
    mx.eval(store.state)
    want = [np.array(b) for b in store.keys]
    for c in caches:
        c.offset = 100  # a tree of 50 nodes at 50..99, its root at 50
    fetched = store.fetch([(c, 51, 49) for c in caches])
    mx.eval(fetched.arrays(), store.state)
    evals = []
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evals.append(1), real(*a))[1])
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    store.keep_paths([(c, 50, [3, 7]) for c in caches], fetched)
    monkeypatch.undo()
    assert evals == []
    mx.eval(store.state)
    grew = mx.get_peak_memory() - base
    assert grew < store.keys[0].nbytes / 4, grew  # no buffer copied
    for w, b in zip(want, store.keys):
        w[:, :, 51], w[:, :, 52] = w[:, :, 53].copy(), w[:, :, 57].copy()
        assert np.array_equal(np.array(b), w)
    assert all(c.offset == 53 for c in caches)
