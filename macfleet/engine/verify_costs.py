"""verify(L): what one verifier forward over L tokens costs on this machine, measured.

A draft tree's size is chosen against this table (engine/tree_budget.py), so it must be what
the verifier really costs here, not a model of it (flat on a Mac GPU, a sawtooth on a CPU). The
probe keeps the fastest of a few runs per length; the table is kept per process and on disk
(per model, weight format, machine and MLX version), except one probed on a loaded machine
(load flattens the curve). The loop's own blocks correct it either way (VerifyCurve.observe).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from macfleet.engine.cachedir import cache_root, machine_id, write_atomic
from macfleet.engine.verifier import Verifier

if TYPE_CHECKING:
    from macfleet.engine.models import LoadedModel

PROBE_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32)
PROBE_CONTEXT = 64
PROBE_REPS = 2
# id(model) -> (a weak reference to it, its table): an id is reused once a model is freed, so
# an entry counts only while its reference still names the model asked about
_memo: dict[int, tuple[weakref.ref, dict[int, float]]] = {}


def _remembered(model: nn.Module) -> dict[int, float] | None:
    got = _memo.get(id(model))
    return got[1] if got is not None and got[0]() is model else None


def _remember(model: nn.Module, table: dict[int, float]) -> None:
    _memo[id(model)] = (weakref.ref(model), table)


def _forward_ms(verifier: Verifier, tokens: Sequence[int]) -> float:
    """ms of one evaluated forward over `tokens` on top of the cached context (rolled back)."""
    base = verifier.offset
    t0 = time.perf_counter()
    mx.eval(verifier.forward(tokens))
    ms = (time.perf_counter() - t0) * 1e3
    verifier.rollback(verifier.offset - base)
    return ms


def probe_verify_costs(model: nn.Module, lengths: Sequence[int] = PROBE_LENGTHS,
                       context: int = PROBE_CONTEXT, reps: int = PROBE_REPS) -> dict[int, float]:
    """ms of one forward over L new tokens after `context` cached ones, fastest of `reps` + 1."""
    vocab = int(model.args.vocab_size)
    v = Verifier(model)
    v.prefill([(7 * i + 3) % vocab for i in range(context)])
    out: dict[int, float] = {}
    for L in lengths:
        toks = [(11 * i + 5) % vocab for i in range(L)]
        out[int(L)] = round(min(_forward_ms(v, toks) for _ in range(reps + 1)), 3)
    return out


def verify_ms_at(costs: Mapping[int, float], L: int) -> float:
    """verify(L) from a table of some lengths: the measured value, else linear between the
    nearest lengths, or along the first or last two beyond them (flat with one length)."""
    if L in costs:
        return costs[L]
    ls = sorted(costs)
    lo = max((x for x in ls if x < L), default=None)
    hi = min((x for x in ls if x > L), default=None)
    if lo is None:
        lo, hi = ls[0], ls[1] if len(ls) > 1 else ls[0]
    elif hi is None:
        lo, hi = (ls[-2], ls[-1]) if len(ls) > 1 else (ls[-1], ls[-1])
    if hi == lo:
        return costs[lo]
    return costs[lo] + (costs[hi] - costs[lo]) * (L - lo) / (hi - lo)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _key(model: nn.Module) -> str:
    """The table's identity: the verifier, its weights' format and the compute it runs on."""
    from macfleet.engine.proposers.eagle.head import verifier_fingerprint

    layer = model.model.layers[0]
    w = getattr(getattr(getattr(layer, "self_attn", None), "q_proj", None), "weight", None)
    fmt = "quantized" if hasattr(getattr(layer.self_attn, "q_proj", None), "scales") else \
        str(getattr(w, "dtype", "?"))
    machine = machine_id(usable_cores())
    raw = f"{verifier_fingerprint(model)}|{fmt}|{machine}|{mx.__version__}|{PROBE_LENGTHS}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def machine_busy(threshold: float = 0.5) -> bool:
    """Is something else using this machine's cores (1-minute load per core)?"""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1) > threshold
    except (OSError, AttributeError):
        return False


def cache_dir() -> Path:
    return cache_root() / "verify-costs"


def table_path(model: nn.Module) -> Path:
    """Where this machine keeps `model`'s table."""
    return cache_dir() / f"{_key(model)}.json"


def known_verify_costs(model: nn.Module) -> dict[int, float] | None:
    """The verify(L) table of `model` if this process or this machine already measured it
    (memoised, or cached on disk); None rather than a probe."""
    got = _remembered(model)
    if got is not None:
        return got
    try:
        got = {int(k): float(v) for k, v in
               json.loads(table_path(model).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return None
    if got:
        _remember(model, got)
    return got or None


def verify_costs(model: nn.Module) -> dict[int, float]:
    """The measured verify(L) table of `model` on this machine (memoised, cached on disk)."""
    got = known_verify_costs(model)
    if got is not None:
        return got
    path = table_path(model)
    busy = machine_busy()
    got = probe_verify_costs(model)
    if not (busy or machine_busy()):  # a loaded machine's table: this process only
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(got))
        except OSError:
            pass  # a read-only home: the process keeps its own copy
    _remember(model, got)
    return got


# -- the full sweep (bench verify-sweep, the agents' verify_sweep preset) -----------------

SWEEP_LENGTHS = tuple(range(1, 33))
SWEEP_CONTEXTS = (64, 512)
SWEEP_REPEATS = 5


def time_verify(verifier: Verifier, L: int, repeats: int) -> float:
    """Median ms of one forward over L tokens on top of the cached context (then rolled back)."""
    xs = [_forward_ms(verifier, [1] * L) for _ in range(repeats)]
    return float(statistics.median(xs)) if xs else 0.0


def verify_sweep(lm: LoadedModel, lengths=SWEEP_LENGTHS, contexts=SWEEP_CONTEXTS,
                 repeats: int = SWEEP_REPEATS, progress=None) -> dict:
    """verify(L) for each length at each context length, as medians and ratios to the first:
    the headroom speculation spends (a record, unlike the probe's table above)."""
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
