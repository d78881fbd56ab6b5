"""Model-based proposers: a separate draft model, or layer-skip self-drafting.

Both run a language model autoregressively with their own KV cache. The layer-skip proposer
wraps the verifier's first K layers plus its final norm and head (`LayerSkipModel`): it shares
the verifier's weights (no extra memory) but keeps its own cache. `LayerSkipModel` is a
drop-in mlx-lm model (callable with `cache=`, has `.layers`), so mlx-lm's own
`speculative_generate_step` can use it as a draft model for side-by-side benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from macfleet.engine.layers import head_logits, run_layers
from macfleet.engine.prefix import common_prefix
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer
from macfleet.engine.sampling import GREEDY, make_rng, probs_from_logits, sample


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
    """Autoregressive drafting with any mlx-lm-compatible model and its own trimmable cache."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model = model
        self.name = name
        self.params = GREEDY
        self._cache: list | None = None
        self._cached: list[int] = []
        self._rng = make_rng(GREEDY, stream=1)

    def start(self, params=GREEDY) -> None:
        self.params = params
        self._cache = make_prompt_cache(self.model)
        self._cached = []
        self._rng = make_rng(params, stream=1)

    def close(self) -> None:
        self._cache = None
        self._cached = []

    def _rollback_to(self, n: int) -> None:
        drop = len(self._cached) - n
        if drop > 0:
            for c in self._cache:
                c.trim(drop)
            del self._cached[n:]

    def _step(self, tokens: Sequence[int]) -> mx.array:
        x = mx.array(list(tokens), dtype=mx.uint32)[None]
        out = self.model(x, cache=self._cache)[0, -1].astype(mx.float32)
        self._cached.extend(int(t) for t in tokens)
        return out

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or not context:
            return EMPTY_DRAFT
        if self._cache is None:
            self.start(self.params)
        t0 = time.perf_counter()
        c = common_prefix(self._cached, context)
        if c == len(context):
            c -= 1  # the logits after the last context token are not cached: recompute them
        self._rollback_to(c)
        logits = self._step(context[c:])
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            if self.params.greedy:
                tok = int(mx.argmax(logits).item())
            else:
                q = probs_from_logits(logits[None], self.params)[0]
                tok = sample(q, self._rng)
                rows.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = self._step([tok])
        probs = np.stack(rows) if rows else None
        return Draft(tuple(tokens), probs, (time.perf_counter() - t0) * 1e3)
