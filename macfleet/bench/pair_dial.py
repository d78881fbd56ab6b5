"""The pair verifier's dials (bench/pair_model.py), measured: how often the draft model agrees
with it (`agreement`, `calibrate`: eps for a target acceptance) and what a draft token costs
beside one verify (`cost_ratio`). `macfleet bench pair-dial` records both in
results/pair_dial.json. A measuring instrument of `macfleet bench pair`, not a user feature.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from macfleet.bench.pair_model import (DEFAULT_EXTRA_LAYERS, DRAFT_SPEC, RMS_TEXT, model_from,
                                       noisy_weights, pair_weights, weights_and_config)
from macfleet.engine import fastmath
from macfleet.engine.models import LoadedModel, load_model
from macfleet.engine.text import encode_prompt
from macfleet.engine.verifier import Verifier

# Everyday requests the dial is calibrated on; kept apart from the prompts `bench pair`
# measures on.
CALIBRATION_PROMPTS = (
    "What should I pack for a weekend camping trip?",
    "Explain how a refrigerator keeps food cold.",
    "List five tips for sleeping better.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Why do leaves change colour in autumn?",
    "Give me a simple recipe for pancakes.",
    "How do I politely decline a meeting invitation?",
    "What is the difference between weather and climate?",
)
DEFAULT_TOKENS = 96
DEFAULT_TARGETS = (0.6, 0.8, 0.95)
EPS_RANGE = (1e-3, 4.0)
NOISE_RANGE = (0.02, 0.3)
DEFAULT_STEPS = 8


def greedy_answer(model: nn.Module, prompt: Sequence[int], tokens: int,
                  eos: frozenset[int] = frozenset()) -> list[int]:
    """The model's greedy answer (a KV cache, one token a step), up to an end token."""
    v = Verifier(model)
    v.prefill(prompt[:-1])
    out: list[int] = []
    t = prompt[-1]
    while len(out) < tokens:
        t = int(mx.argmax(v.forward([t])[-1]).item())
        out.append(t)
        if t in eos:
            break
    return out


def greedy_answers(model: nn.Module, prompts: Sequence[Sequence[int]], tokens: int,
                   eos: frozenset[int] = frozenset()) -> list[list[int]]:
    """Every prompt's greedy answer (end token included), decoded as one batch by mlx-lm's
    BatchGenerator (left-padded; RoPE is relative, so the same answers but for near-ties)."""
    from mlx_lm.generate import BatchGenerator  # transformers with it: ~2 s, for this only

    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(eos)] or None)
    try:
        uids = gen.insert([list(p) for p in prompts], [tokens] * len(prompts))
        got: dict[int, list[int]] = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid].append(int(r.token))
    finally:
        gen.close()
    return [got[u][:tokens] for u in uids]


def teacher_forced_argmax(model: nn.Module, seqs: Sequence[Sequence[int]]) -> list[list[int]]:
    """argmax of the next token at every position, one batched forward (right-padded: causal
    attention keeps the padding out of every real position)."""
    n = max(len(s) for s in seqs)
    x = mx.array([list(s) + [0] * (n - len(s)) for s in seqs], dtype=mx.uint32)
    am = mx.argmax(model(x), axis=-1).tolist()
    return [row[: len(s)] for row, s in zip(am, seqs)]


def agreement_models(verifier: nn.Module, draft: nn.Module, prompts: Sequence[Sequence[int]],
                     tokens: int = DEFAULT_TOKENS, eos: frozenset[int] = frozenset()) -> float:
    """Per-token greedy acceptance: the share of the verifier's own greedy answer positions
    where argmax(draft) == argmax(verifier), both teacher-forced over prompt + answer."""
    seqs = [list(p) + a for p, a in zip(prompts, greedy_answers(verifier, prompts, tokens, eos))]
    va, da = teacher_forced_argmax(verifier, seqs), teacher_forced_argmax(draft, seqs)
    hit = total = 0
    for s, p, v, d in zip(seqs, prompts, va, da):
        for i in range(len(p) - 1, len(s) - 1):  # the positions that predict answer tokens
            hit += v[i] == d[i]
            total += 1
    return hit / total if total else 1.0


def encode_chat(lm: LoadedModel, prompts: Sequence[str]) -> list[list[int]]:
    return [encode_prompt(lm.tokenizer, p, chat=True) for p in prompts]


def agreement(verifier_dir: Path | str, draft_spec: str = DRAFT_SPEC,
              prompts: Sequence[str] = CALIBRATION_PROMPTS, tokens: int = DEFAULT_TOKENS
              ) -> float:
    """`agreement_models` for a built verifier directory and a draft spec, on chat prompts."""
    v = load_model(str(verifier_dir), cached=False)
    d = load_model(draft_spec)
    return agreement_models(v.model, d.model, encode_chat(v, prompts), tokens, v.eos_ids)


@dataclass(frozen=True)
class DialPoint:
    eps: float
    acceptance: float


@dataclass(frozen=True)
class DialSetting:
    target: float
    eps: float
    acceptance: float  # measured at eps
    tried: tuple[DialPoint, ...]  # every point the bisection measured, in order


def bisect_log(measure: Callable[[float], float], target: float, lo: float, hi: float,
               steps: int, seen: dict[float, float] | None = None,
               tolerance: float = 0.0) -> DialSetting:
    """The eps in [lo, hi] whose measure is nearest `target`, by bisection on log(eps)
    (measure falls as eps grows), stopping early within `tolerance`. `seen` memoises
    measurements across targets. Choose the bracket so its geometric middle is the guess."""
    seen = {} if seen is None else seen
    tried: list[DialPoint] = []
    best: DialPoint | None = None
    for _ in range(max(1, steps)):
        mid = math.exp((math.log(lo) + math.log(hi)) / 2)
        if mid not in seen:
            seen[mid] = measure(mid)
        a = seen[mid]
        tried.append(DialPoint(mid, a))
        if best is None or abs(a - target) < abs(best.acceptance - target):
            best = DialPoint(mid, a)
        if abs(a - target) <= tolerance:
            break
        lo, hi = (mid, hi) if a > target else (lo, mid)
    assert best is not None
    return DialSetting(target, best.eps, best.acceptance, tuple(tried))


def calibrate(width: int, target: float, *, extra_layers: int = DEFAULT_EXTRA_LAYERS,
              seed: int = 0, prompts: Sequence[str] = CALIBRATION_PROMPTS,
              tokens: int = DEFAULT_TOKENS, steps: int = DEFAULT_STEPS,
              eps_range: tuple[float, float] = EPS_RANGE,
              seen: dict[float, float] | None = None, tolerance: float = 0.0,
              progress: Callable[[str], None] | None = None) -> DialSetting:
    """eps for per-token acceptance near `target`. The verifiers are built in memory; their
    function does not depend on `width` (zero padding), so calibrating at the model's own
    width (1536, the fastest) holds for every width."""
    draft = load_model(DRAFT_SPEC)
    ids = encode_chat(draft, prompts)
    rms_ids = encode_prompt(draft.tokenizer, RMS_TEXT, chat=False)

    def measure(eps: float) -> float:
        w, cfg = pair_weights(draft.model, rms_ids, width, extra_layers, eps, seed)
        verifier = model_from(w, cfg)
        fastmath.install(verifier)  # as `load_model` of the built directory gives it
        a = agreement_models(verifier, draft.model, ids, tokens, draft.eos_ids)
        if progress:
            progress(f"eps {eps:.4g}: acceptance {a:.3f}")
        return a

    return bisect_log(measure, target, *eps_range, steps, seen, tolerance)


def calibrate_draft(target: float, *, seed: int = 0,
                    prompts: Sequence[str] = CALIBRATION_PROMPTS, tokens: int = DEFAULT_TOKENS,
                    steps: int = DEFAULT_STEPS, noise_range: tuple[float, float] = NOISE_RANGE,
                    seen: dict[float, float] | None = None, tolerance: float = 0.0,
                    progress: Callable[[str], None] | None = None) -> DialSetting:
    """The draft dial: the draft's weight noise (pair_model.noisy_weights) for per-token
    acceptance near `target`, against a verifier that is SmolLM2 itself (every eps-0 pair
    verifier computes SmolLM2's function, at any width). DialSetting.eps holds the noise."""
    base = load_model(DRAFT_SPEC)
    ids = encode_chat(base, prompts)
    w, cfg = weights_and_config(base.model)

    def measure(noise: float) -> float:
        draft = model_from(noisy_weights(w, noise, seed), cfg)
        fastmath.install(draft)  # as `load_model` of the built directory gives it
        a = agreement_models(base.model, draft, ids, tokens, base.eos_ids)
        if progress:
            progress(f"draft noise {noise:.4g}: acceptance {a:.3f}")
        return a

    return bisect_log(measure, target, *noise_range, steps, seen, tolerance)


# ---------------------------------------------------------------------------------------------
# cost: one draft token against verify(L), on one core

def pin_to_core(core: int = 0) -> None:
    """This process and every thread it has onto one core (Linux; threads started later
    inherit it)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass
    os.sched_setaffinity(0, {core})


def decode_ms(model: nn.Module, lengths: Sequence[int], context: int = 128,
              reps: int = 5) -> dict[int, tuple[float, float]]:
    """Fastest ms of one forward over L new tokens after `context` cached ones (then rolled
    back), for each L: a decode step at L = 1, verify(L) beyond. (wall, CPU) each: on a
    pinned core of a loaded machine the process's CPU time is the steadier measure (other
    processes' turns on the core do not count; their use of the memory bus still does)."""
    vocab = int(model.args.vocab_size)
    v = Verifier(model)
    v.prefill([(7 * i + 3) % vocab for i in range(context)])
    out: dict[int, tuple[float, float]] = {}
    for L in lengths:
        toks = [(11 * i + 5) % vocab for i in range(L)]
        wall = cpu = float("inf")
        for _ in range(reps + 1):  # the first run warms the shape up
            t0, c0 = time.perf_counter(), time.process_time()
            mx.eval(v.forward(toks))
            wall = min(wall, (time.perf_counter() - t0) * 1e3)
            cpu = min(cpu, (time.process_time() - c0) * 1e3)
            v.rollback(L)
        out[int(L)] = (round(wall, 2), round(cpu, 2))
    return out


@dataclass(frozen=True)
class CostRatio:
    width: int
    extra_layers: int
    draft_token_ms: float  # wall
    draft_token_cpu_ms: float
    verify_ms: dict[int, float]  # L -> wall ms
    verify_cpu_ms: dict[int, float]  # L -> CPU ms
    c: float  # draft token / verify(1), CPU time
    c_wall: float  # the same, wall time
    c_bytes: float  # the same ratio from bytes read per token


def cost_ratio(verifier_dir: Path | str, draft_spec: str = DRAFT_SPEC,
               lengths: Sequence[int] = (1, 5, 9), *, core: int | None = 0,
               context: int = 128, reps: int = 5) -> CostRatio:
    """c = one draft token / verify(1) of the verifier, both on one core (`core`; None: as
    the process runs), fastest of `reps` (a loaded machine's noise only ever adds)."""
    from macfleet.bench.pair_model import param_bytes, weights_and_config

    if core is not None:
        pin_to_core(core)
    d = load_model(draft_spec)
    v = load_model(str(verifier_dir), cached=False)
    dr = decode_ms(d.model, (1,), context, reps)[1]
    ver = decode_ms(v.model, lengths, context, reps)
    dr2 = decode_ms(d.model, (1,), context, reps)[1]  # again: load drifts while we measure
    dr = (min(dr[0], dr2[0]), min(dr[1], dr2[1]))
    vcfg, dcfg = weights_and_config(v.model)[1], weights_and_config(d.model)[1]
    one = ver[min(ver)]
    return CostRatio(int(vcfg["intermediate_size"]),
                     int(vcfg["num_hidden_layers"]) - int(dcfg["num_hidden_layers"]),
                     dr[0], dr[1], {L: w for L, (w, _) in ver.items()},
                     {L: c for L, (_, c) in ver.items()},
                     round(dr[1] / one[1], 4), round(dr[0] / one[0], 4),
                     round(param_bytes(dcfg) / param_bytes(vcfg), 4))
