"""Where each session's KV comes from and goes (serve/session_kv.py); a store, no model."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from engine_parts_kit import session

from macfleet.engine.batch_kv import BatchKV
from macfleet.serve.prompt_cache import PromptCache
from macfleet.serve.session_kv import OWN_STORE_PROMPT, SessionKV, copy_features

LAYERS, HEADS, DIM = 2, 1, 2


class Model:
    layers = [None] * LAYERS


def _session_kv(prompt_cache=None, clock=lambda: 0.0) -> SessionKV:
    session_kv = SessionKV(Model(), BatchKV(LAYERS, step=8), prompt_cache, clock)
    session_kv._layout = SimpleNamespace(dtype="float32")  # what a forward of a model would read
    return session_kv


def _fill(s, n: int) -> None:
    """Write n positions into s's row (every layer), as a prefill would."""
    store, c = s.cache.store, s.cache
    store.reserve(c.row + 1, c.offset + n)
    k = mx.array(np.arange(c.offset, c.offset + n, dtype=np.float32).repeat(HEADS * DIM)
                 .reshape(n, HEADS, 1, DIM))
    for i in range(LAYERS):
        store.write(i, k, k, store.slot_index(np.full(n, c.row),
                                              np.arange(c.offset, c.offset + n), HEADS))
    c.offset += n


def test_a_short_prompt_is_a_row_of_the_shared_store_a_long_one_has_its_own():
    session_kv = _session_kv()
    short, long = session(0), session(1, prompt=range(OWN_STORE_PROMPT + 1))
    session_kv.open(short)
    session_kv.open(long)
    assert short.cache.store is session_kv.kv_store and long.cache.store is not session_kv.kv_store
    assert long.cache.store.capacity >= OWN_STORE_PROMPT + 1  # room for it all at once
    session_kv.close(short, done=False)
    assert short.cache is None and session_kv.kv_store.open_rows == 0


def test_a_finished_session_leaves_its_kv_to_the_prompt_cache_and_a_later_one_reuses_it():
    cache = PromptCache(1 << 20, min_tokens=4)
    session_kv = _session_kv(cache)
    prompt = tuple(range(1, 11))
    a = session(0, prompt=prompt)
    session_kv.open(a)
    _fill(a, 12)
    a.context = [*prompt, 20, 21]  # answered two tokens; the last one is not in the cache
    session_kv.close(a, done=True)
    assert len(cache) == 1
    b = session(1, prompt=(*prompt[:6], 99))
    session_kv.open(b)
    session_kv.reuse(b)
    h = b.kv_handle
    assert h.cached == 6 and h.shipped_kv is not None  # installed over the next iterations
    fails = []
    session_kv.install_some([b], 0.0, lambda s, why: fails.append(why))
    assert not fails and h.shipped_kv is None and h.prefilled == 6 and b.prefill_left == 0
    np.testing.assert_array_equal(np.array(session_kv.kv_store.keys[1][b.cache.row, 0, :6, 0]),
                                  np.arange(6))
    cancelled = session(2, prompt=prompt)
    session_kv.open(cancelled)
    _fill(cancelled, 9)
    cancelled.context = list(prompt)
    session_kv.close(cancelled, done=False)
    assert cache.lookups == 1 and len(cache) == 1  # nothing kept of a cancelled one


def test_an_install_stops_at_its_time_budget_and_a_bad_kv_fails_its_session_alone():
    now = [0.0]

    def clock():
        now[0] += 0.010  # every reading: 10 ms later
        return now[0]

    session_kv = _session_kv(clock=clock)
    ok, bad = session(0, prompt=range(5)), session(1, prompt=range(5))
    for s in (ok, bad):
        session_kv.open(s)
    ok.kv_handle.shipped_kv = [(np.ones((HEADS, 4, DIM), np.float32),) * 2] * LAYERS
    # not this model's
    bad.kv_handle.shipped_kv = [(np.ones((HEADS, 4, DIM), np.float32),) * 2] * (LAYERS + 1)
    session_kv.install_some([ok, bad], 15.0, lambda s, why: pytest_fail(s, why))
    h = ok.kv_handle
    assert h.installed == 1 and h.shipped_kv is not None  # one layer, then the budget was spent
    fails = []
    session_kv.install_some([ok, bad], 0.0, lambda s, why: fails.append((s.sid, why)))
    assert ok.kv_handle.shipped_kv is None and ok.kv_handle.prefilled == 4
    assert len(fails) == 1 and fails[0][0] == 1 and "shipped KV" in fails[0][1]


def pytest_fail(s, why):
    raise AssertionError(f"session {s.sid} failed: {why}")


def test_a_shared_prompt_prefix_is_copied_and_a_session_behind_one_prefilling_it_waits():
    session_kv = _session_kv()
    prompt = tuple(range(1, 21))
    src, dst, later = (session(i, prompt=(*prompt, 30 + i)) for i in range(3))
    for s in (src, dst, later):
        session_kv.open(s)
    # both wait for the first's prefill
    assert session_kv.share_prefixes([src, dst, later]) == [src]
    _fill(src, 20)
    src.kv_handle.prefilled = 20
    out = session_kv.share_prefixes([src, dst, later])
    assert out == [src, dst, later] and dst.kv_handle.shared == dst.kv_handle.prefilled == 20
    assert later.kv_handle.prefilled == 20
    np.testing.assert_array_equal(np.array(session_kv.kv_store.keys[0][dst.cache.row, 0, :20, 0]),
                                  np.arange(20))


class Feeds:
    wants_features = True

    def __init__(self, rows=None) -> None:
        self.rows, self.fed = rows, []

    def feature_rows(self, n):
        return None if self.rows is None else self.rows[:n]

    def feed_features(self, start, tokens, h):
        self.fed.append((start, tuple(tokens), h))


def test_hidden_state_rows_follow_a_copied_prefix_or_the_copy_is_refused():
    src, dst = session(0, prompt=range(10)), session(1, prompt=range(10))
    assert copy_features(src, dst, 5)  # no drafter reads features: nothing to copy
    dst.feeds = [Feeds()]
    src.feeds = [Feeds()]  # holds no rows
    assert not copy_features(src, dst, 5)
    src.feeds = [Feeds(rows=list(range(10)))]
    assert copy_features(src, dst, 5)
    assert dst.feeds[0].fed == [(0, (0, 1, 2, 3, 4), [0, 1, 2, 3, 4])]
