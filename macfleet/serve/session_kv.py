"""Where each session's KV cache comes from and where it goes: a row of the engine's shared
`BatchKV` store (`kv_store`; a long prompt gets a store of its own), or its own `Verifier`'s
caches (batch-invariant mode). A prompt prefix may come without a prefill: copied from another
session's row (`share_prefixes`), or installed from the prompt cache or a shipped KV a few
layers per iteration (`install_some`); a finished row goes into the prompt cache (`retain`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx

from macfleet.engine.batch_kv import BatchKV, RowCache
from macfleet.engine.verifier import Verifier
from macfleet.serve.batch_session import BatchSession, KVHandle
from macfleet.serve.prompt_cache import PromptCache, row_kv
from macfleet.serve.scheduler import PrefixView, plan_prefix_sharing

log = logging.getLogger(__name__)

OWN_STORE_PROMPT = 512  # prompts longer than this keep their KV in a store of their own
DEFAULT_DECODE_MS = 100.0  # the decode iteration assumed before one is measured

CopyFeatures = Callable[[BatchSession, BatchSession, int], bool]


def copy_features(src: BatchSession, dst: BatchSession, n: int) -> bool:
    """A copied prefix's hidden-state rows, from the source's drafters to the destination's
    (pairwise: one engine spec makes the same drafters); False when the source's do not hold
    them all (the destination then prefills itself)."""
    if not dst.feeds:
        return True
    rows = [p.feature_rows(n) for p in src.feeds]
    if len(rows) != len(dst.feeds) or any(r is None for r in rows):
        return False
    for p, h in zip(dst.feeds, rows):
        p.feed_features(0, dst.req.prompt[:n], h)
    return True


class SessionKV:
    """kv_store: the shared store (None: per-session verifiers, the batch-invariant mode);
    prompt_cache: finished requests' KV for later prompts that start the same (or None);
    verifier: the one every session runs through, reset for each (one session at a time);
    None: a new `Verifier` of the model each."""

    def __init__(self, model, kv_store: BatchKV | None, prompt_cache: PromptCache | None,
                 clock: Callable[[], float], verifier: Verifier | None = None) -> None:
        self.model, self.kv_store, self.prompt_cache = model, kv_store, prompt_cache
        self.clock, self.verifier = clock, verifier
        self.draft_rows: dict[int, BatchKV] = {}  # local chain drafters' caches, a store a model
        self._layout = None  # the model's KV layout, read when a shipped KV first arrives

    def open(self, s: BatchSession) -> None:
        """An admitted session's empty cache (and its EAGLE head's row)."""
        h = s.kv_handle
        if self.kv_store is None:
            if self.verifier is not None:
                self.verifier.reset()
            h.cache = self.verifier or Verifier(self.model)
            return
        # a long prompt gets a store of its own: growing the shared one to its length would
        # copy every row's keys (a stall for every decoder beside it)
        store = (self.kv_store if len(s.req.prompt) <= OWN_STORE_PROMPT
                 else BatchKV(len(self.model.layers), row_step=1))
        h.cache = store.open()
        store.reserve(h.cache.row + 1, len(s.req.prompt))
        if s.proposer is not None:  # its drafter's cache: a row of its model's store
            s.proposer.share_rows(self.draft_rows)

    def reuse(self, s: BatchSession) -> None:
        """Its prompt's KV from the prompt cache, when one is there (installed as a shipped
        KV is, over iterations); a shipped KV into per-session caches at once."""
        h = s.kv_handle
        if self.prompt_cache is not None and h.shipped_kv is None and not s.feeds:
            h.cached, h.shipped_kv = self.prompt_cache.lookup(s.req.prompt, s.req.partition)
        if h.shipped_kv is not None and not isinstance(h.cache, RowCache):
            self._install(h)  # batch-invariant mode: per-session caches, at once

    def close(self, s: BatchSession, done: bool) -> None:
        """Free its cache; a session that finished leaves its KV in the prompt cache."""
        if isinstance(s.cache, RowCache):
            if done and self.prompt_cache is not None:
                self._retain(s)
            s.cache.close()
        s.kv_handle.cache = None

    def _retain(self, s: BatchSession) -> None:
        """A finished session's KV (prompt and answer) into the prompt cache: the positions
        whose tokens are its context (not a cut-off stop token's)."""
        n = min(s.cache.offset, len(s.context) - 1)
        if n < self.prompt_cache.min_tokens or s.cache.store.keys[0] is None:
            return
        try:
            self.prompt_cache.insert(s.context[:n], row_kv(s.cache.store, s.cache.row, n),
                                     s.req.partition)
        except (RuntimeError, ValueError, MemoryError) as e:  # not kept: later prompts prefill
            log.warning("session %d: KV not kept in the prompt cache: %s", s.sid, e)

    # -- shipped and cached prompt KVs ----------------------------------------------------
    def _model_layout(self):
        from macfleet.engine.kvship import model_layout

        if self._layout is None:
            self._layout = model_layout(self.model)
        return self._layout

    def _install(self, h: KVHandle) -> None:
        """A shipped prompt KV into the session's fresh per-layer caches, all at once."""
        from macfleet.engine.kvship import install

        install(h.cache.cache, self._model_layout(), h.shipped_kv)
        self._installed(h)

    def _installed(self, h: KVHandle) -> None:
        n, h.shipped_kv = h.shipped_kv[0][0].shape[1], None
        h.advance(n, self.clock())

    def install_some(self, installing: list[BatchSession], budget_ms: float,
                     fail: Callable[[BatchSession, str], None]) -> None:
        """Copy shipped prompt KVs into their batch rows, layer by layer, oldest first, for at
        most `budget_ms` (0: all; at least one layer), so a long prompt's KV never stalls the
        batch in one piece (results/disagg-8000-*.json); one that fails fails alone."""
        t0 = self.clock()
        dtype = getattr(mx, self._model_layout().dtype)
        moved = False
        for s in installing:
            h = s.kv_handle
            n_layers = len(h.shipped_kv)
            while h.installed < n_layers:
                spent = (self.clock() - t0) * 1e3
                if budget_ms > 0 and moved and spent + h.layer_ms > budget_ms:
                    return
                moved = True
                t1 = self.clock()
                try:
                    h.cache.store.install(h.cache, h.shipped_kv, dtype,
                                          range(h.installed, h.installed + 1))
                except Exception as e:  # noqa: BLE001 - one bad KV fails its session alone
                    log.exception("session %d: shipped KV could not be installed", s.sid)
                    fail(s, f"could not install the shipped KV: {type(e).__name__}: {e}")
                    break
                h.layer_ms = max(h.layer_ms, (self.clock() - t1) * 1e3)
                h.installed += 1
                if h.installed == n_layers:
                    self._installed(h)

    # -- prompt prefixes shared between sessions ------------------------------------------
    def share_prefixes(self, batch: list[BatchSession], copy: CopyFeatures = copy_features
                       ) -> list[BatchSession]:
        """New sessions copy the prompt prefix another session's cache holds; those about to
        get one from a session ahead of them sit this iteration out (returned: the others).
        copy: moves the prefix's hidden-state rows between their drafters (`copy_features`)."""
        if self.kv_store is None or not any(s.kv_handle.prefilled == 0 < s.prefill_left
                                            for s in batch):
            return batch
        # copies stay within a store and a cache partition; sessions fed hidden states copy
        # among themselves, with the source drafters' rows of the prefix
        mine = [s for s in batch if s.cache.store is self.kv_store]
        copies, waiting = (), frozenset()
        groups = [[s for s in mine if not s.feeds],
                  [s for s in mine if s.feeds and all(hasattr(p, "feature_rows")
                                                      for p in s.feeds)]]
        for group in [[s for s in g if s.req.partition == part] for g in groups
                      for part in dict.fromkeys(s.req.partition for s in g)]:
            c, w = plan_prefix_sharing([PrefixView(s.sid, tuple(s.context[:s.cache.offset]),
                                                   s.req.prompt[:-1]) for s in group])
            copies, waiting = (*copies, *c), waiting | w
        by_sid = {s.sid: s for s in batch}
        copies = [c for c in copies if copy(by_sid[c.src], by_sid[c.dst], c.tokens)]
        if copies:
            self.kv_store.copy_prefixes([(by_sid[c.src].cache, by_sid[c.dst].cache, c.tokens)
                                   for c in copies])
        for c in copies:
            dst = by_sid[c.dst].kv_handle
            dst.shared = c.tokens
            dst.advance(c.tokens, self.clock())
            log.debug("session %d: %d prompt tokens from session %d's cache", c.dst, c.tokens,
                      c.src)
        return [s for s in batch if s.sid not in waiting]
