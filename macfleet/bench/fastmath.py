"""`macfleet bench fastmath`: the CPU's exp/SiLU/softmax (engine/fastmath.py) against MLX's own
ops, interleaved in one process (results/fastmath.json).

Measured: one flat decode iteration of R sessions at a context (the serving loop's forward,
`batch.flat_forward`), and one session's own forward of L tokens (the `generate` path: only the
MLP's SiLU changes there), each the median of interleaved repeats; and how far the logits of
the two arithmetics move apart (max abs difference, argmax agreement).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from macfleet.engine import fastmath
from macfleet.engine.models import LoadedModel

FLAT_CASES = ((16, 300), (8, 300), (16, 100), (1, 300))
BLOCKS = (1, 4, 16)


def _use(model, on: bool) -> None:
    if on:
        os.environ.pop(fastmath.EXACT_ENV, None)
    else:
        os.environ[fastmath.EXACT_ENV] = "1"
    fastmath.install(model, on)


def _ab(model, run: Callable[[], float], repeats: int) -> dict:
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for on in (True, False):
            _use(model, on)
            times[on].append(run())
    f, e = (statistics.median(times[k][2:]) for k in (True, False))  # first two: warm-up
    return {"exact_ms": round(e, 2), "fast_ms": round(f, 2), "speedup": round(e / f, 3)}


def bench_fastmath(lm: LoadedModel, repeats: int = 12,
                   progress: Callable[[str], None] = lambda s: None) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    from macfleet.engine.batch import BatchKV, Segment, flat_forward, trim_cache

    if mx.default_device() != mx.cpu:
        raise ValueError("fastmath is the CPU's: this process computes on " +
                         str(mx.default_device()))
    m = lm.model
    rng = np.random.default_rng(0)
    was = os.environ.get(fastmath.EXACT_ENV)
    flat, own = [], []
    try:
        for rows, ctx in FLAT_CASES:
            store = BatchKV(len(m.layers))
            caches = [store.open() for _ in range(rows)]
            flat_forward(m, [Segment(tuple(int(t) for t in rng.integers(1, lm.vocab_size, ctx)), c,
                                     None) for c in caches])
            nxt = [int(t) for t in rng.integers(1, lm.vocab_size, rows)]
            last: list = []  # the latest step's logits

            def step() -> float:
                t = time.perf_counter()
                out = flat_forward(m, [Segment((x,), c, 0) for x, c in zip(nxt, caches)])
                dt = time.perf_counter() - t
                for c in caches:
                    trim_cache(c, 1)
                last[:] = out
                return dt * 1e3

            row = {"sessions": rows, "context": ctx, **_ab(m, step, repeats)}
            logits = {}
            for on in (True, False):
                _use(m, on)
                step()
                logits[on] = np.concatenate([np.array(o) for o in last])
            row["max_abs_logit_diff"] = float(np.abs(logits[True] - logits[False]).max())
            row["argmax_agree"] = float(np.mean(logits[True].argmax(-1)
                                                == logits[False].argmax(-1)))
            flat.append(row)
            progress(f"flat decode, {rows} sessions at {ctx}: {row['exact_ms']} -> "
                     f"{row['fast_ms']} ms ({row['speedup']}x)")
            for c in caches:
                c.close()
        ctx_ids = mx.array([[int(t) for t in rng.integers(1, lm.vocab_size, 200)]])
        for L in BLOCKS:
            block = mx.array([[int(t) for t in rng.integers(1, lm.vocab_size, L)]])

            def fwd() -> float:
                cache = make_prompt_cache(m)
                mx.eval(m(ctx_ids, cache=cache))
                t = time.perf_counter()
                mx.eval(m(block, cache=cache))
                return (time.perf_counter() - t) * 1e3

            own.append({"block": L, "context": 200, **_ab(m, fwd, max(6, repeats // 2))})
            progress(f"one session, verify({L}): {own[-1]['exact_ms']} -> "
                     f"{own[-1]['fast_ms']} ms ({own[-1]['speedup']}x)")
    finally:
        if was is None:
            os.environ.pop(fastmath.EXACT_ENV, None)
        else:
            os.environ[fastmath.EXACT_ENV] = was
        fastmath.install(m, fastmath.enabled())
    return {"model": lm.spec, "repeats": repeats, "flat_decode": flat, "one_session": own,
            "method": "interleaved A/B in one process (fast, exact, fast, ...), median of the "
                      "repeats after two warm-ups; exact = MACFLEET_EXACT_MATH=1 and mlx-lm's "
                      "MLP (MLX's own exp, sigmoid and fused attention)"}
