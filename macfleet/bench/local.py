"""`macfleet bench local`: one process, one model, every decoding method side by side.

Methods, interleaved per repeat so machine noise hits all of them alike:
  mlx_generate_step         mlx-lm's plain decoding (the baseline)
  mlx_speculative[<draft>]  mlx-lm's own speculative_generate_step with the same draft model
  macfleet[<proposer>]      macfleet (the serving engine, one request) with each proposer
Tokens/s is decode throughput over the same number of tokens (prompt processing excluded for
all methods alike), median of the repeats.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step

from macfleet.bench.record import median
from macfleet.engine.events import Finished
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import make_proposer
from macfleet.engine.proposers.model_draft import LayerSkipModel
from macfleet.engine.text import encode_prompt
from macfleet.serve.one import decode_ids

DEFAULT_MAX_TOKENS = 64
DEFAULT_LAYERSKIP = 20
DEFAULT_FIXED_K = 4


def _mlx_tokens(gen, n: int, eos) -> tuple[list[int], float]:
    """Drive an mlx-lm step generator; returns (ids, decode seconds after the first token)."""
    ids: list[int] = []
    t_first = None
    for item, _ in zip(gen, range(n)):
        y = int(item[0])
        if t_first is None:
            t_first = time.perf_counter()
        if y in eos:
            break
        ids.append(y)
    return ids, time.perf_counter() - (t_first or time.perf_counter())


def run_mlx_plain(lm: LoadedModel, ids: list[int], n: int):
    return _mlx_tokens(generate_step(mx.array(ids), lm.model, max_tokens=n), n, lm.eos_ids)


def run_mlx_spec(lm: LoadedModel, ids: list[int], n: int, draft, k: int):
    gen = speculative_generate_step(mx.array(ids), lm.model, draft, num_draft_tokens=k,
                                    max_tokens=n)
    return _mlx_tokens(gen, n, lm.eos_ids)


def run_macfleet(lm: LoadedModel, ids: list[int], n: int, proposer: str, k):
    prop = make_proposer(proposer, lm)
    fin = None
    for ev in decode_ids(lm, ids, prop, draft_tokens=k if prop is not None else 0,
                         max_tokens=n):
        if isinstance(ev, Finished):
            fin = ev
    st = fin.stats
    return list(fin.token_ids), st.elapsed_s - st.prefill_ms / 1e3, st


N_METHODS = 6  # each prompt is run this many ways per repeat


def bench_local(lm: LoadedModel, prompts: dict[str, str], *, max_tokens=DEFAULT_MAX_TOKENS,
                repeats: int = 2, layerskip: int = DEFAULT_LAYERSKIP, k: int = DEFAULT_FIXED_K,
                progress=None) -> dict:
    draft = LayerSkipModel(lm.model, layerskip)
    methods = {
        "mlx_generate_step": lambda ids: run_mlx_plain(lm, ids, max_tokens),
        f"mlx_speculative[layerskip:{layerskip},k={k}]":
            lambda ids: run_mlx_spec(lm, ids, max_tokens, draft, k),
        "macfleet[none]": lambda ids: run_macfleet(lm, ids, max_tokens, "none", 0),
        f"macfleet[layerskip:{layerskip},k={k}]":
            lambda ids: run_macfleet(lm, ids, max_tokens, f"layerskip:{layerskip}", k),
        f"macfleet[layerskip:{layerskip},auto]":
            lambda ids: run_macfleet(lm, ids, max_tokens, f"layerskip:{layerskip}", "auto"),
        "macfleet[ngram,auto]": lambda ids: run_macfleet(lm, ids, max_tokens, "ngram", "auto"),
    }
    assert len(methods) == N_METHODS  # the runs `macfleet bench local` counts down
    out = {}
    for pname, text in prompts.items():
        ids = encode_prompt(lm.tokenizer, text, chat=True)
        runs: dict[str, list[float]] = {m: [] for m in methods}
        extra: dict[str, dict] = {}
        ref = None
        for _ in range(repeats):
            for m, fn in methods.items():
                res = fn(ids)
                toks, secs = res[0], res[1]
                if ref is None:
                    ref = toks
                # tokens after the first (the first is prompt processing for mlx-lm)
                runs[m].append((len(toks) - 1) / secs if m.startswith("mlx") else len(toks) / secs)
                if len(res) > 2:
                    st = res[2]
                    extra[m] = {"acceptance": round(st.acceptance, 3),
                                "mean_accepted": round(st.mean_accepted, 3),
                                "identical_to_plain": toks == ref}
                if progress:
                    progress(f"{pname} {m}: {runs[m][-1]:.1f} tok/s")
        base = median(runs["mlx_generate_step"])
        spec = median(runs[f"mlx_speculative[layerskip:{layerskip},k={k}]"])
        out[pname] = {
            "tokens": len(ref or []),
            "methods": {
                m: {"tokens_per_s": round(median(v), 2),
                    "ratio_to_mlx_generate_step": round(median(v) / base, 3),
                    "ratio_to_mlx_speculative": round(median(v) / spec, 3),
                    **extra.get(m, {})}
                for m, v in runs.items()
            },
        }
    return {"model": lm.spec, "max_tokens": max_tokens, "repeats": repeats, "prompts": out}
