"""Verifier features (the last layer's pre-norm hidden states): computed (`hidden_states`), or
recorded from the verifier's own forward by a `HiddenTap` (docs/drafters.md, "eagle/features.py").
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from macfleet.engine.layers import run_layers

_TAP = "_macfleet_tap"


def hidden_states(model: nn.Module, ids: mx.array, cache=None) -> mx.array:
    """ids [B, L] -> pre-norm hidden of the last layer [B, L, H] (appends to `cache`)."""
    return run_layers(model.model.layers, model.model.embed_tokens(ids), cache)


# -- tapping the verifier's own forward ----------------------------------------------------


class HiddenTap:
    """Receives (start, tokens, hidden[L, H]) for every full forward of the tapped model."""

    def __init__(self) -> None:
        self.records: list[tuple[int, list[int], mx.array]] = []
        self._pending: tuple[int, list[int]] | None = None

    def _begin(self, start: int, tokens: list[int]) -> None:
        self._pending = (start, tokens)

    def _record(self, h: mx.array) -> None:
        if self._pending is not None:
            start, toks = self._pending
            self.records.append((start, toks, h[0]))
            self._pending = None

    def drain(self) -> list[tuple[int, list[int], mx.array]]:
        r, self.records = self.records, []
        return r


def _tapped_class(base: type, kind: str) -> type:
    name = f"Tapped{base.__name__}"
    if kind == "model":

        def __call__(self, inputs, cache=None, input_embeddings=None, **kw):
            tap = self.__dict__.get(_TAP)
            if tap is None or input_embeddings is not None:
                return base.__call__(self, inputs, cache, input_embeddings, **kw)
            c0 = cache[0] if cache else None
            start = int(getattr(c0, "offset", 0)) if c0 is not None else 0
            tap._begin(start, np.array(inputs[0]).astype(np.int64).tolist())
            self.norm.__dict__[_TAP] = tap
            try:
                return base.__call__(self, inputs, cache, input_embeddings, **kw)
            finally:
                self.norm.__dict__.pop(_TAP, None)
    else:

        def __call__(self, x):
            tap = self.__dict__.get(_TAP)
            if tap is not None:
                tap._record(x)
            return base.__call__(self, x)

    return type(name, (base,), {"__call__": __call__, "_macfleet_base": base})


def attach_tap(model: nn.Module, tap: HiddenTap) -> None:
    """Record the verifier's pre-norm hidden states into `tap` on every full forward."""
    inner = model.model
    for mod, kind in ((inner, "model"), (inner.norm, "norm")):
        if not hasattr(type(mod), "_macfleet_base"):
            mod.__class__ = _tapped_class(type(mod), kind)
    inner.__dict__[_TAP] = tap


def detach_tap(model: nn.Module, tap: HiddenTap) -> None:
    inner = model.model
    if inner.__dict__.get(_TAP) is tap:
        inner.__dict__.pop(_TAP, None)
