"""`macfleet bench batch-identity`: does batching change any greedy answer? Over many requests.

Each request is decoded alone (plain decoding: the serving engine on the model's own forward,
one session) and by the continuous-batching engine with many sessions at once, flat batch (default),
flat batch with n-gram drafts, and batch-invariant mode. A request diverges when its ids
differ; for each divergence we record where, and the alone run's top-2 logit margin there:
flat-batch rows can differ from single-row ones in the last float bits (OpenBLAS picks other
kernels for 1-row and small matrices), which flips the argmax only at near-ties.
The engine is stepped on this thread (no engine thread, nothing to abort at exit).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from macfleet.engine.events import Finished
from macfleet.engine.models import LoadedModel
from macfleet.engine.sampling import GREEDY
from macfleet.engine.verifier import Verifier
from macfleet.serve.engine import BatchEngine, EngineRequest
from macfleet.serve.one import decode_ids

SUBJECTS = ("the moon", "a bicycle", "Python lists", "the French revolution", "bread",
            "photosynthesis", "a violin", "the stock market", "volcanoes", "chess",
            "the internet", "honey bees", "a compiler", "rainbows", "the Roman empire",
            "coffee", "black holes", "a marathon", "tea", "glaciers")
FORMS = ("Tell me about {}.", "Write two sentences about {}.", "What is special about {}?",
         "Explain {} to a child.", "Give three facts about {}.", "Why do people like {}?",
         "Describe {} in one paragraph.", "What should I know about {}?",
         "Write a short poem about {}.", "What are common mistakes about {}?")

MODES = {"flat": ("none", False), "flat_ngram": ("ngram", False), "invariant": ("none", True)}


def prompts_for(lm: LoadedModel, n: int, seed: int = 0) -> list[tuple[int, ...]]:
    tok = lm.tokenizer
    if getattr(tok, "has_chat_template", False):
        qs = [f.format(s) for f, s in itertools.islice(itertools.product(FORMS, SUBJECTS), n)]
        return [tuple(tok.apply_chat_template([{"role": "user", "content": q}],
                                              add_generation_prompt=True)) for q in qs]
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, lm.vocab_size, size=int(rng.integers(4, 200))).tolist())
            for _ in range(n)]


def alone(lm: LoadedModel, prompt, max_tokens: int) -> tuple[int, ...]:
    evs = list(decode_ids(lm, prompt, max_tokens=max_tokens, verifier=Verifier(lm.model)))
    return evs[-1].token_ids


def batched(lm: LoadedModel, prompts, max_tokens: int, proposer: str, invariant: bool,
            concurrency: int) -> tuple[list[tuple[int, ...]], int]:
    eng = BatchEngine(lm, proposer=proposer, invariant=invariant, max_active=concurrency,
                      max_queue=len(prompts))
    out: dict[int, tuple[int, ...]] = {}
    for i, p in enumerate(prompts):
        def emit(ev, i=i):
            if isinstance(ev, Finished):
                out[i] = ev.token_ids
        eng.submit(EngineRequest(p, GREEDY, max_tokens, lm.eos_ids), emit)
    eng.run_until_idle()
    return [out.get(i, ()) for i in range(len(prompts))], eng.iterations


def margin_at(lm: LoadedModel, prompt, ids, pos: int) -> float:
    """Top-1 minus top-2 logit of the alone run at output position pos."""
    v = Verifier(lm.model)
    ctx = [*prompt, *ids[:pos]]
    v.prefill(ctx[:-1])
    row = np.array(v.forward(ctx[-1:])[0])
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


def bench_identity(lm: LoadedModel, n: int, max_tokens: int, concurrency: int,
                   progress: Callable[[str], None]) -> dict:
    prompts = prompts_for(lm, n)
    t0 = time.perf_counter()
    ref = [alone(lm, p, max_tokens) for p in prompts]
    res = {"model": lm.spec, "requests": n, "max_tokens": max_tokens,
           "concurrency": concurrency, "alone_s": round(time.perf_counter() - t0, 2),
           "modes": {}}
    progress(f"alone: {n} requests in {res['alone_s']} s")
    for mode, (proposer, invariant) in MODES.items():
        t0 = time.perf_counter()
        got, iters = batched(lm, prompts, max_tokens, proposer, invariant, concurrency)
        div = []
        for i, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                           min(len(a), len(b)))
                div.append({"request": i, "position": pos, "of": len(a),
                            "alone_top2_margin": round(margin_at(lm, prompts[i], a, pos), 6)})
        res["modes"][mode] = {"proposer": proposer, "batch_invariant": invariant,
                              "diverged": len(div), "divergence_rate": round(len(div) / n, 4),
                              "iterations": iters,
                              "seconds": round(time.perf_counter() - t0, 2),
                              "divergences": div}
        progress(f"{mode}: {len(div)}/{n} requests diverge ({res['modes'][mode]['seconds']} s)")
        mx.clear_cache()
    return res
