"""verify(L) for L = 1..32 at two context lengths: the headroom speculation spends."""

from __future__ import annotations

import time

import mlx.core as mx

from macfleet.bench.record import median
from macfleet.engine.models import LoadedModel
from macfleet.engine.verifier import Verifier

DEFAULT_LENGTHS = tuple(range(1, 33))
DEFAULT_CONTEXTS = (64, 512)
DEFAULT_REPEATS = 5


def time_verify(verifier: Verifier, L: int, repeats: int) -> float:
    """Median ms of one forward over L tokens on top of the cached context (then rolled back)."""
    xs = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = verifier.forward([1] * L)
        mx.eval(out)
        xs.append((time.perf_counter() - t) * 1e3)
        verifier.rollback(L)
    return median(xs)


def verify_sweep(lm: LoadedModel, lengths=DEFAULT_LENGTHS, contexts=DEFAULT_CONTEXTS,
                 repeats: int = DEFAULT_REPEATS, progress=None) -> dict:
    curves = []
    for ctx in contexts:
        v = Verifier(lm.model)
        v.prefill([(i * 7919) % lm.vocab_size for i in range(ctx)])
        time_verify(v, 4, 2)  # warm up
        ms = {}
        for L in lengths:
            ms[L] = time_verify(v, L, repeats)
            if progress:
                progress(f"context {ctx} L={L}: {ms[L]:.1f} ms")
        base = ms[lengths[0]]
        curves.append({
            "context": ctx,
            "points": [{"L": L, "ms": round(ms[L], 3), "ratio_to_L1": round(ms[L] / base, 3)}
                       for L in lengths],
        })
    return {"model": lm.spec, "repeats": repeats, "curves": curves}
