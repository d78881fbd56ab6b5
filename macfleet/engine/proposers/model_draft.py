"""Model-based proposers: a separate draft model, or the verifier's first K layers
(`LayerSkipModel`: shared weights, its own cache; a drop-in mlx-lm model)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from macfleet.engine.batch import Segment, flat_forward
from macfleet.engine.batch_kv import BatchKV, RowCache
from macfleet.engine.layers import head_logits, run_layers
from macfleet.engine.prefix import common_prefix
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer, draft_in_rows
from macfleet.engine.sampling import GREEDY, make_rng, probs_from_logits, sample
from macfleet.engine.tree_verify import supports_tree_attention


class LayerSkipModel(nn.Module):
    """The first `k` layers of a llama-style model, followed by its final norm and LM head."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        n = len(model.layers)
        if not 1 <= k <= n:
            raise ValueError(f"layer-skip depth must be 1..{n} for this model, got {k}")
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
            raise ValueError("layer-skip drafting needs a llama-style model (embed, layers, norm)")
        self._full = model
        self.k = k
        self.args = model.args

    @property
    def layers(self) -> list:
        return self._full.layers[: self.k]

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        inner = self._full.model
        h = inner.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        return head_logits(self._full, run_layers(self.layers, h, cache))


class ModelProposer(Proposer):
    """Autoregressive drafting with any mlx-lm model and its own trimmable cache (mlx-lm's, or a
    row of a store shared with other sessions' drafters: `share_rows`)."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model = model
        self.name = name
        self.params = GREEDY
        self._cache: list | None = None
        self.rows: BatchKV | None = None  # `share_rows`
        self._cached: list[int] = []
        self._rng = make_rng(GREEDY, stream=1)

    def share_rows(self, stores: dict) -> None:
        """Its cache a row of its model's store (its next draft runs its context again)."""
        if supports_tree_attention(self.model):
            self._drop_cache()
            self.rows = stores.setdefault(id(self.model), BatchKV(len(self.model.layers)))
            self._cache = [self.rows.open()]

    @staticmethod
    def draft_together(jobs, clock=time.perf_counter) -> list[Draft]:
        return draft_model_chains(jobs, clock)

    def start(self, params=GREEDY) -> None:
        self.params = params
        self._drop_cache()
        self._cache = [self.rows.open()] if self.rows is not None else make_prompt_cache(
            self.model)
        self._rng = make_rng(params, stream=1)

    def close(self) -> None:
        self._drop_cache()
        self.rows = None

    def _drop_cache(self) -> None:
        if self._cache and isinstance(self._cache[0], RowCache):
            self._cache[0].close()
        self._cache = None
        self._cached = []

    def _catch_up(self, context: Sequence[int]) -> list[int]:
        """Roll the cache back to what it shares with `context`; the tokens still to run (at
        least the last: the logits after it are never cached)."""
        if self._cache is None:
            self.start(self.params)
        c = common_prefix(self._cached, context)
        if c == len(context):
            c -= 1
        if len(self._cached) > c:
            for cache in self._cache:
                cache.trim(len(self._cached) - c)
            del self._cached[c:]
        return [int(t) for t in context[c:]]

    def _step(self, tokens: Sequence[int]) -> mx.array:
        x = mx.array(list(tokens), dtype=mx.uint32)[None]
        out = self.model(x, cache=self._cache)[0, -1].astype(mx.float32)
        self._cached.extend(int(t) for t in tokens)
        return out

    def _pick(self, logits: mx.array, rows: list[np.ndarray]) -> int:
        """The argmax, or a draw (its distribution goes to `rows`)."""
        if self.params.greedy:
            return int(mx.argmax(logits).item())
        q = probs_from_logits(logits[None], self.params)[0]
        rows.append(q)
        return sample(q, self._rng)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or not context:
            return EMPTY_DRAFT
        if self.rows is not None:
            return draft_model_chains([(self, context, k)])[0]
        t0 = time.perf_counter()
        logits = self._step(self._catch_up(context))
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            tokens.append(self._pick(logits, rows))
            if i + 1 < k:
                logits = self._step([tokens[-1]])
        return Draft(tuple(tokens), np.stack(rows) if rows else None,
                     (time.perf_counter() - t0) * 1e3)


def draft_model_chains(jobs: Sequence[tuple[ModelProposer, Sequence[int], int]],
                       clock: Callable[[], float] = time.perf_counter) -> list[Draft]:
    """Every job's (proposer, context, k) chain at once, the caches rows of one store: one flat
    forward per draft position for all (`draft_in_rows`)."""
    def run(ps, news):  # each one's new tokens into its row: the logits after the last
        for p, new in zip(ps, news):
            p._cached.extend(new)
        return [lg[-1] for lg in flat_forward(ps[0].model, [
            Segment(tuple(new), p._cache[0], len(new) - 1) for p, new in zip(ps, news)])]

    return draft_in_rows(jobs, clock, 1, "draft_model_chains drafts for proposers whose caches "
                         "are rows of one store (share_rows)",
                         lambda ps, ctxs: (run(ps, [p._catch_up(c) for p, c in zip(ps, ctxs)]),
                                           None), lambda _, lgs: mx.stack(lgs),
                         lambda ps, _, toks: run(ps, [[t] for t in toks]))
