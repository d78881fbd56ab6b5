"""EagleProposer: chains from the EAGLE head over the verifier's own hidden states, tapped from
its forwards; many sessions' chains drafted together (docs/drafters.md, "eagle/chain.py")."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from macfleet.engine.batch import BatchKV, RowCache, Segment, flat_layers
from macfleet.engine.prefix import common_prefix
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer, draft_in_rows
from macfleet.engine.proposers.eagle.features import (HiddenTap, attach_tap, detach_tap,
                                                      hidden_states)
from macfleet.engine.proposers.eagle.head import EagleHead
from macfleet.engine.sampling import GREEDY, make_rng, probs_from_logits, sample


class _FeatureStore:
    """Hidden rows by position, mirroring what the verifier's cache has seen."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.segments: list[tuple[int, mx.array]] = []  # (start, hidden [L, H]), ascending

    def write(self, start: int, tokens: Sequence[int], h: mx.array) -> None:
        start = min(start, len(self.tokens))
        del self.tokens[start:]
        self.tokens.extend(int(t) for t in tokens)
        kept = [(s, a[: start - s] if s + a.shape[0] > start else a)
                for s, a in self.segments if s < start]
        self.segments = [*kept, (start, h)]

    def first(self, n: int) -> mx.array | None:
        """Rows of positions 0..n-1 ([n, H]), None unless it holds them all."""
        return self.rows(0, n) if 0 < n <= len(self.tokens) else None

    def rows(self, a: int, b: int) -> mx.array:
        """Hidden rows for positions a..b-1 ([b - a, H])."""
        parts = []
        for s, arr in self.segments:
            e = s + arr.shape[0]
            if e <= a or s >= b:
                continue
            parts.append(arr[max(a - s, 0) : min(b, e) - s])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


class EagleProposer(Proposer):
    wants_features = True

    def __init__(self, head: EagleHead, name: str = "eagle") -> None:
        self.head = head
        self.name = name
        self.use_tap = True  # `untap`: its features fed instead
        self.params = GREEDY
        self._rng = make_rng(GREEDY, stream=1)
        self._tap: HiddenTap | None = None
        self.rows: BatchKV | None = None  # the store its head cache is a row of (share_rows)
        self._row: RowCache | None = None
        self._reset_state()
        self.fallback_tokens = 0  # tokens whose features the proposer computed itself

    def _reset_state(self) -> None:
        self._store = _FeatureStore()
        self._own_cache: list | None = None
        self._own_tokens: list[int] = []
        self._head_cache = self._new_head_cache()
        self._head_ctx: list[int] = []  # x_0..x_m: pairs (f_i, x_{i+1}) i < m are in the cache

    def _new_head_cache(self) -> list:
        if self._row is not None:
            self._row.close()
            self._row = None
        if self.rows is None:
            return self.head.make_cache()
        self._row = self.rows.open()
        return [self._row]  # one row holds every layer of the head: trimmed once

    def share_rows(self, stores: dict) -> None:
        """A chain drafter (not a tree's): its head's cache a row of that head's store, its
        drafts then from `draft_chains`."""
        if not self.drafts_trees:
            self.rows = stores.setdefault(id(self.head), BatchKV(len(self.head.layers)))
            self._reset_state()

    @staticmethod
    def draft_together(jobs, clock=time.perf_counter) -> list[Draft]:
        return draft_chains(jobs, clock)

    def start(self, params=GREEDY) -> None:
        self.params = params
        self._rng = make_rng(params, stream=1)
        self._reset_state()
        if self.use_tap and self._tap is None:
            self._tap = HiddenTap()
            attach_tap(self.head.verifier, self._tap)

    def close(self) -> None:
        if self._tap is not None:
            detach_tap(self.head.verifier, self._tap)
            self._tap = None
        self.rows = None
        self._reset_state()

    # -- features ----------------------------------------------------------------------
    def untap(self) -> None:
        self.use_tap = False

    def feed_features(self, start: int, tokens: Sequence[int], h) -> None:
        """Hidden rows computed elsewhere (flow F3) for positions start.. of `tokens`."""
        self._store.write(start, [int(t) for t in tokens], mx.array(h))

    def feature_rows(self, n: int) -> mx.array | None:
        """Its hidden rows of positions 0..n-1 ([n, H]), None unless it holds them all."""
        return self._store.first(n)

    def _sync_features(self, context: Sequence[int]) -> None:
        """Make the store hold f_0..f_{T-2} for this context (T = len(context))."""
        if self._tap is not None:
            for start, toks, h in self._tap.drain():
                self._store.write(start, toks, h)
        need = len(context) - 1
        ok = common_prefix(self._store.tokens[:need], context[:need])
        if ok >= need:
            return
        # fallback (a verifier forward over the new tokens): the tap did not see them
        v = self.head.verifier
        if self._own_cache is None:
            self._own_cache = [KVCache() for _ in v.layers]
        c = min(common_prefix(self._own_tokens, context[:need]), ok)
        drop = len(self._own_tokens) - c
        if drop > 0:
            for kv in self._own_cache:
                kv.trim(drop)
            del self._own_tokens[c:]
        new = list(context[c:need])
        h = hidden_states(v, mx.array(new, dtype=mx.uint32)[None], self._own_cache)[0]
        self._own_tokens.extend(new)
        self.fallback_tokens += len(new)
        self._store.write(c, new, h)

    # -- drafting ----------------------------------------------------------------------
    def _pick(self, logits: mx.array, rows: list[np.ndarray]) -> int:
        """The draft token from the head's logits [V] or [V'] (a draw's pmf goes to `rows`)."""
        ids = self.head.draft_ids
        if self.params.greedy:
            i = int(mx.argmax(logits).item())
            return i if ids is None else int(ids[i].item())
        if ids is not None:  # a full-vocabulary q with zeros outside the draft vocabulary
            full = np.full(self.head.config.vocab_size, -np.inf, dtype=np.float32)
            full[np.array(ids)] = np.array(logits)
            logits = mx.array(full)
        q = probs_from_logits(logits[None], self.params)[0]
        rows.append(q)
        return sample(q, self._rng)

    def _root(self, context: list[int]) -> mx.array:
        """The head's predicted feature after `context` [1, 1, H], its cache brought up to it."""
        feats, nxt = self._root_inputs(context)
        return self.head(feats, nxt, cache=self._head_cache)[:, -1:]

    def _root_inputs(self, context: list[int]) -> tuple[mx.array, mx.array]:
        """Roll the head's cache back to the pairs still valid for `context`; the pairs to run,
        feats [1, n, H] and next tokens [1, n] (n >= 1: the last one's output is the root)."""
        self._sync_features(context)
        m = max(len(self._head_ctx) - 1, 0)
        T = len(context)
        valid = min(m, max(common_prefix(self._head_ctx, context) - 1, 0), T - 2)
        if m - valid:
            for c in self._head_cache:
                c.trim(m - valid)
        feats = self._store.rows(valid, T - 1)[None]  # f_valid .. f_{T-2}
        nxt = mx.array(context[valid + 1 : T], dtype=mx.uint32)[None]  # x_{valid+1} .. x_{T-1}
        self._head_ctx = context
        return feats.astype(mx.float32), nxt

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or len(context) < 2:
            return EMPTY_DRAFT
        if self.rows is not None:
            return draft_chains([(self, context, k)])[0]
        t0 = time.perf_counter()
        context = [int(t) for t in context]
        h = self._root(context)
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            tok = self._pick(self.head.draft_logits(h[0, -1]).astype(mx.float32), rows)
            tokens.append(tok)
            if i + 1 < k:
                h = self.head(h, mx.array([[tok]], dtype=mx.uint32), cache=self._head_cache)
        if k - 1:
            for c in self._head_cache:
                c.trim(k - 1)
        return Draft(tuple(tokens), np.stack(rows) if rows else None,
                     (time.perf_counter() - t0) * 1e3)


def draft_chains(jobs: Sequence[tuple[EagleProposer, Sequence[int], int]],
                 clock: Callable[[], float] = time.perf_counter) -> list[Draft]:
    """Every job's (proposer, context, k) chain at once, the head caches rows of one store
    (`share_rows`): one head forward and one draft-vocabulary matmul per draft position for all
    (`draft_in_rows`)."""
    def run(ps, feats, nxt, lens):  # pairs into each row: the predicted feature after its last
        outs = flat_layers(ps[0].head.layers, ps[0].head.inputs(feats, nxt),
                           [Segment(tuple(range(n)), p._row) for p, n in zip(ps, lens)])
        return [o[-1] for o in outs]

    def roots(ps, ctxs):  # each session's root: the predicted feature after its context
        fs, ts = zip(*(p._root_inputs([int(t) for t in c]) for p, c in zip(ps, ctxs)))
        ids = ps[0].head.draft_ids
        return (run(ps, mx.concatenate(fs, axis=1), mx.concatenate(ts, axis=1),
                    [t.shape[1] for t in ts]), None if ids is None else np.array(ids))

    out = draft_in_rows(jobs, clock, 2, "draft_chains drafts for proposers whose head caches are "
                        "rows of one store (share_rows)", roots,
                        lambda ps, hs: ps[0].head.draft_logits(mx.stack(hs)).astype(mx.float32),
                        lambda ps, hs, toks: run(ps, mx.stack(hs)[None],
                                                 mx.array([toks], dtype=mx.uint32), [1] * len(ps)),
                        lazy_roots=True)
    for (p, _, _), d in zip(jobs, out):
        if len(d):
            p._row.trim(len(d) - 1)  # the drafted pairs: the committed ones stay
    return out


class VerifierFeatures:
    """The verifier's side of F3: the hidden rows of committed positions, tapped from its own
    forwards (tap=False: fed by a batching engine, whose flat forward runs no tap)."""

    def __init__(self, model, tap: bool = True) -> None:
        self.model = model
        self._tap = HiddenTap() if tap else None
        self._store = _FeatureStore()
        if self._tap is not None:
            attach_tap(model, self._tap)

    def feed(self, start: int, tokens: Sequence[int], h: mx.array) -> None:
        self._store.write(start, [int(t) for t in tokens], h)

    def feature_rows(self, n: int) -> mx.array | None:
        """The rows of positions 0..n-1 ([n, H]), None unless it holds them all."""
        self._drain()
        return self._store.first(n)

    def _drain(self) -> None:
        for start, toks, h in (self._tap.drain() if self._tap is not None else ()):
            self._store.write(start, toks, h)

    def rows(self, a: int, b: int) -> np.ndarray | None:
        """float16 rows for positions a..b-1, or None when the verifier has not computed them."""
        self._drain()
        if b <= a or len(self._store.tokens) < b:
            return None
        return np.array(self._store.rows(a, b).astype(mx.float16))

    def close(self) -> None:
        if self._tap is not None:
            detach_tap(self.model, self._tap)
