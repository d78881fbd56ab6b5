"""The shell of `bench overhead`: runs the models (bench/overhead.py: what the numbers mean).

Every macfleet run goes through the serving engine with one request (serve/one.py: the
token-level `run_one` for plain and oracle runs, `generate_one`, text and all, for the default
drafter): what `generate --local` runs, so the bench measures whatever that path is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from macfleet.bench.oracle import OracleProposer
from macfleet.bench.overhead import (DEFAULT_KS, DEFAULT_MAX_ITERATIONS, OracleTrace, Run, best,
                                     departure_summary, follow_reference, oracle_summary,
                                     ratio_summary)
from macfleet.bench.weights import BenchModel
from macfleet.engine.events import Finished
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers.base import Proposer
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.verify_costs import PROBE_LENGTHS, probe_verify_costs
from macfleet.serve.engine import BatchEngine, EngineRequest
from macfleet.serve.one import run_one

PLAIN, MLX, TEXT_PLAIN = "plain", "mlx_generate_step", "plain (text)"
SAMPLED, MLX_SAMPLED = "plain sampled", "mlx_generate_step sampled"
SAMPLED_T = 0.8  # sampled plain decoding: the draw on the device against mlx-lm's sampler
SYNC = "plain (synchronous)"  # the same engine, each step read back before the next is built
RANDOM_PROMPT_TOKENS = 16
BIG_CURVE_LENGTHS = (1, 2, 4, 8, 16, 32)  # a big model's forwards are dear: fewer lengths
VERIFY_REPS = 3


def timed(events: Iterable) -> Run:
    """Drive a decode's events (TokensCommitted or TextDelta, then Finished) into a Run."""
    first_t = last_t = None
    first_n, fin = 0, None
    for ev in events:
        toks = getattr(ev, "tokens", None)
        if toks:
            last_t = time.perf_counter()
            if first_t is None:
                first_t, first_n = last_t, len(toks)
        elif isinstance(ev, Finished):
            fin = ev
    st, n = fin.stats, len(fin.token_ids)
    decode_s = st.elapsed_s - st.prefill_ms / 1e3
    stream = ((n - first_n) / (last_t - first_t)
              if first_t is not None and n > first_n and last_t > first_t else 0.0)
    return Run(tuple(fin.token_ids), n / decode_s if decode_s > 0 else 0.0, stream,
               st.drafted, st.accepted)


def engine_for(bm: BenchModel, step_ahead: bool = True) -> BatchEngine:
    """A serving engine for one request at a time on `bm` (random weights: no tokenizer);
    step_ahead False: each step read back before the next is built."""
    lm = bm.lm or LoadedModel(bm.label, bm.model, None, "random", False)
    return BatchEngine(lm, proposer="none", max_active=1, max_queue=1, step_ahead=step_ahead)


def run_engine(engine: BatchEngine, proposer: Proposer | None, ids: Sequence[int],
               tokens: int, k: int, eos: frozenset[int], params: SamplingParams = GREEDY) -> Run:
    """One request through `engine` with `proposer` at a fixed block length k."""
    req = EngineRequest(tuple(ids), params, tokens, eos_ids=eos,
                        draft_tokens=k if proposer else 0, report_blocks=True)
    return timed(run_one(engine, req, proposer))


def run_mlx(model, ids: Sequence[int], tokens: int, eos: frozenset[int],
            temperature: float = 0.0) -> Run:
    """mlx-lm's plain decoding; its rate after the first token (prompt processing excluded)."""
    out: list[int] = []
    t_first = t_last = None
    sampler = make_sampler(temp=temperature) if temperature else None
    for y, _ in generate_step(mx.array(list(ids)), model, max_tokens=tokens, sampler=sampler):
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
        if int(y) in eos:
            break
        out.append(int(y))
    rate = (len(out) - 1) / (t_last - t_first) if len(out) > 1 and t_last > t_first else 0.0
    return Run(tuple(out), rate, rate)


def random_prompts(vocab: int, count: int, length: int = RANDOM_PROMPT_TOKENS
                   ) -> dict[str, list[int]]:
    return {f"random{i}": np.random.default_rng(i).integers(0, vocab, length).tolist()
            for i in range(count)}


def measure_model(bm: BenchModel, prompts: Mapping[str, Sequence[int]], *, tokens: int,
                  rounds: int, ks: Sequence[int] = DEFAULT_KS, mlx: bool = True,
                  oracle: bool = True, texts: Mapping[str, str] | None = None,
                  default_spec: str | None = None,
                  max_runs: int = DEFAULT_MAX_ITERATIONS,
                  curve_lengths: Sequence[int] = PROBE_LENGTHS,
                  deadline: float | None = None,
                  progress: Callable[[str], None] = lambda s: None) -> dict:
    """One model's section of results/overhead-<device>.json. Past `deadline` (monotonic
    seconds) no further timed round starts (one always runs)."""
    say = (lambda s: progress(f"[{bm.label}] {s}"))
    engine = engine_for(bm)
    eos = bm.lm.eos_ids if bm.lm is not None else frozenset()
    lengths = sorted({1, *curve_lengths, *(k + 1 for k in ks)})
    verify_ms = probe_verify_costs(bm.model, lengths, reps=VERIFY_REPS)
    say("verify(L) ms: " + ", ".join(f"{L}:{verify_ms[L]:.1f}" for L in lengths))
    plain = {p: run_engine(engine, None, ids, tokens, 0, eos) for p, ids in prompts.items()}
    traces: dict[tuple[str, int], OracleTrace] = {}
    if oracle:
        for p, ids in prompts.items():
            for k in ks:
                def once(ref, ids=ids, k=k):
                    return run_engine(engine, OracleProposer([*ids, *ref]), ids, tokens, k,
                                    eos).tokens
                traces[p, k] = follow_reference(once, plain[p].tokens, max_runs)
                t = traces[p, k]
                say(f"{p} oracle k={k}: {t.runs} run(s), departures at {list(t.departures)}"
                    + ("" if t.converged else " (not converged)"))
    sync = engine_for(bm, step_ahead=False)
    methods: dict[str, Callable[[str], Run]] = {
        PLAIN: lambda p: run_engine(engine, None, prompts[p], tokens, 0, eos),
        SYNC: lambda p: run_engine(sync, None, prompts[p], tokens, 0, eos)}
    if mlx:
        hot = SamplingParams(SAMPLED_T, seed=0)
        methods[MLX] = lambda p: run_mlx(bm.model, prompts[p], tokens, eos)
        methods[SAMPLED] = lambda p: run_engine(engine, None, prompts[p], tokens, 0, eos, hot)
        methods[MLX_SAMPLED] = lambda p: run_mlx(bm.model, prompts[p], tokens, eos, SAMPLED_T)
    for k in ks if oracle else ():
        methods[f"oracle k={k}"] = (lambda p, k=k: run_engine(
            engine, OracleProposer([*prompts[p], *traces[p, k].reference]), prompts[p],
            tokens, k, eos))
    section_c: dict | None = None
    if texts and default_spec and bm.lm is not None:
        section_c = _default_methods(bm, texts, tokens, default_spec, methods)
    runs: dict[str, dict[str, list[Run]]] = {p: {m: [] for m in methods} for p in prompts}
    for r in range(rounds + 1):  # round 0 warms every shape up and is not kept
        for p in prompts:
            for m, fn in methods.items():
                run = fn(p)
                if r:
                    runs[p][m].append(run)
                say(f"round {r}{' (warm-up)' if not r else ''} {p} {m}: "
                    f"{run.decode_tps:.1f} tok/s (stream {run.stream_tps:.1f})")
        if r and r < rounds and deadline is not None and time.monotonic() > deadline:
            say(f"time limit: {r} of {rounds} timed rounds")
            rounds = r
            break
    section = {"label": bm.label, "weights": bm.weights, "params": bm.params,
               "tokens": tokens, "rounds": rounds,
               "verify_ms": {int(L): v for L, v in verify_ms.items()},
               "prompts": {p: _prompt_doc(ids, plain[p], runs[p], traces, p, ks)
                           for p, ids in prompts.items()}}
    best_of = {m: {p: best(runs[p][m], "stream_tps" if m in (PLAIN, SYNC, MLX, SAMPLED, MLX_SAMPLED) else
                           "decode_tps")
                   for p in prompts} for m in methods}
    plain_decode = {p: best(runs[p][PLAIN]) for p in prompts}
    # what pipelining buys: the same engine with every step read back before the next is built
    section["pipelined_vs_synchronous"] = ratio_summary(
        {p: best(runs[p][PLAIN], "stream_tps") for p in prompts}, best_of[SYNC])
    if mlx:
        section["plain_vs_mlx"] = ratio_summary({p: best(runs[p][PLAIN], "stream_tps")
                                                 for p in prompts}, best_of[MLX])
        # sampled answers differ in length (EOS): tokens/s after the first token, each its own
        section["sampled_plain_vs_mlx"] = ratio_summary(best_of[SAMPLED], best_of[MLX_SAMPLED])
    if oracle:
        section["oracle"] = [oracle_summary(
            ratio_summary(best_of[f"oracle k={k}"], plain_decode)["per_prompt"], verify_ms, k,
            all(r.all_accepted for p in prompts for r in runs[p][f"oracle k={k}"]))
            for k in ks]
        section["departures"] = departure_summary({f"{p}:k{k}": t for (p, k), t in
                                                   traces.items()})
    if section_c is not None:
        spec = section_c["spec"]
        if section_c.get("error") is None:
            section_c["speedup"] = ratio_summary(best_of[spec], best_of[TEXT_PLAIN])
        section["default_drafter"] = section_c
    return section


def _default_methods(bm: BenchModel, texts: Mapping[str, str], tokens: int, spec: str,
                     methods: dict) -> dict:
    """Part (c): plain and the default drafter through `generate_one` (what `generate --local`
    runs, text and all), added to `methods`."""
    from macfleet.engine.proposers import ProposerSpecError
    from macfleet.serve.one import generate_one

    def gen(p: str, proposer: str) -> Run:
        return timed(generate_one(bm.lm, texts[p], proposer=proposer, max_tokens=tokens))
    try:
        gen(next(iter(texts)), spec)  # a drafter that cannot be built here says so once
    except (ProposerSpecError, ValueError) as e:
        return {"spec": spec, "error": str(e)}
    methods[TEXT_PLAIN] = lambda p: gen(p, "none")
    methods[spec] = lambda p: gen(p, spec)
    return {"spec": spec, "error": None}


def _prompt_doc(ids: Sequence[int], plain: Run, runs: Mapping[str, Sequence[Run]],
                traces: Mapping[tuple[str, int], OracleTrace], p: str, ks: Sequence[int]) -> dict:
    doc = {"prompt_tokens": len(ids), "answer_tokens": len(plain.tokens), "methods": {}}
    for m, rs in runs.items():
        doc["methods"][m] = {
            "decode_tps": [round(r.decode_tps, 2) for r in rs],
            "stream_tps": [round(r.stream_tps, 2) for r in rs],
            "drafted": [r.drafted for r in rs], "accepted": [r.accepted for r in rs],
            "identical_to_plain": (None if m in (SAMPLED, MLX_SAMPLED)  # sampled: n/a
                                   else all(r.tokens == plain.tokens for r in rs))}
    doc["oracle_runs"] = {f"k={k}": {"runs": traces[p, k].runs,
                                     "departures": list(traces[p, k].departures),
                                     "converged": traces[p, k].converged}
                          for k in ks if (p, k) in traces}
    return doc
