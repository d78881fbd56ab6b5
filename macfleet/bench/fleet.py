"""`macfleet bench fleet`: one process vs two agent processes, same prompts, same model.

Methods, interleaved per repeat:
  mlx_generate_step                 mlx-lm plain decoding, this process (baseline)
  mlx_speculative[layerskip:K]      mlx-lm's one-process spec-decode with the layer-skip draft
  macfleet_local[P]                 macfleet's loop in this process, proposer P
  agent_alone                       the verifier agent decoding alone (pinned to one core: the
                                    fair baseline for the agent rows)
  agents[P, no cross-round]         verifier agent + proposer agent, proposer P
  agents[P, cross-round]            same, the proposer pre-drafting the next block
Tokens/s is decode throughput (prompt processing excluded), median of the repeats.

First contact (`first_request`, before anything else runs): the agents start on an empty
macfleet cache directory (a machine macfleet never ran on), and the first request with the
fleet's default drafter is timed end to end on the client (prompt included) against the same
request asked again, warm. Agents warm up before they advertise (agents/warmup.py), so the
ratio should be ~1.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
from bridge.messages import GenerateDone
from macfleet.bench.local import run_macfleet, run_mlx_plain, run_mlx_spec
from macfleet.bench.record import median
from macfleet.engine.controller import AUTO
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers.model_draft import LayerSkipModel
from macfleet.engine.text import encode_prompt
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen
from macfleet.stats import GenerationStats

DEFAULT_PROPOSERS = ("ngram", "layerskip:20")


def _figures(st: GenerationStats) -> dict[str, float]:
    """What results/fleet.json records of an agent run."""
    out = {"acceptance": st.acceptance, "mean_accepted": st.mean_accepted}
    if st.fleet is not None:
        f = st.fleet.flows
        if f.remote_blocks:
            out.update(f1_bytes_per_block=f.f1_bytes_per_block,
                       f2_bytes_per_block=f.f2_bytes_per_block, f1_ms_per_block=f.f1_ms_per_block,
                       f2_ms_per_block=f.f2_ms_per_block)
        out["multihost_overhead"] = st.fleet.multihost_overhead
        if f.remote_blocks:
            out.update(predraft_hit_rate=f.predraft_hit_rate,
                       proposer_compute_ms_per_block=f.proposer_compute_ms_per_block)
    return out


def _remote(card, key, prompt, n, proposers, spec, cross_round, k=AUTO) -> GenerateDone:
    for msg in generate_remote(card, key, prompt=prompt, max_tokens=n, proposers=proposers,
                               proposer_spec=spec, cross_round=cross_round, draft_tokens=k):
        if isinstance(msg, GenerateDone):
            return msg
    raise RuntimeError("no result from the verifier agent")


FIRST_PROMPT = "Explain in two sentences why the sky is blue."
DEFAULT_WARM_REPEATS = 3


@contextmanager
def empty_cache():
    """MACFLEET_CACHE pointing at a new empty directory while the block runs (the agents
    started in it inherit it): what a machine that never ran macfleet has."""
    old = os.environ.get("MACFLEET_CACHE")
    with tempfile.TemporaryDirectory(prefix="macfleet-empty-cache-") as d:
        os.environ["MACFLEET_CACHE"] = d
        try:
            yield d
        finally:
            if old is None:
                os.environ.pop("MACFLEET_CACHE", None)
            else:
                os.environ["MACFLEET_CACHE"] = old


def _timed(card, key, prompt, n, proposers, spec) -> dict:
    t0 = time.perf_counter()
    d = _remote(card, key, prompt, n, proposers, spec, False)
    wall = time.perf_counter() - t0
    st = d.stats
    return {"wall_s": round(wall, 4), "tokens": len(d.token_ids),
            "tokens_per_s": round(len(d.token_ids) / wall, 3),
            "decode_tokens_per_s": round(st.decode_tokens_per_s, 3),
            "prefill_ms": round(st.prefill_ms, 2)}


def first_request(v, p, key, spec: str, *, prompt: str = FIRST_PROMPT, max_tokens: int = 48,
                  warm_repeats: int = DEFAULT_WARM_REPEATS) -> dict:
    """The first request a fresh fleet gets (default drafter `spec`), then the same request
    `warm_repeats` times: client-side tokens/s of each (prompt included), and first / warm."""
    eps = [p.router_endpoint] * len(spec.split("+")) if spec != "none" else []
    first = _timed(v, key, prompt, max_tokens, eps, spec)
    warm = [_timed(v, key, prompt, max_tokens, eps, spec) for _ in range(warm_repeats)]
    return {"proposer": spec, "prompt": prompt, **first_vs_warm(first, warm)}


def first_vs_warm(first: dict, warm: list[dict]) -> dict:
    """Pure: the first run's figures against the median of the warm ones (`_timed` records)."""
    warm_tps = median([w["tokens_per_s"] for w in warm])
    warm_prefill = median([w["prefill_ms"] for w in warm])
    return {"first": first, "warm": warm, "warm_tokens_per_s": warm_tps,
            "first_over_warm": round(first["tokens_per_s"] / warm_tps, 3) if warm_tps else 0.0,
            "prefill_ms_first_over_warm": round(first["prefill_ms"] / warm_prefill, 3)
            if warm_prefill else 0.0}


def bench_fleet(lm: LoadedModel, prompts: dict[str, str], *, max_tokens: int = 48,
                repeats: int = 2, layerskip: int = 20, k: int = 4,
                proposers=DEFAULT_PROPOSERS, progress=None, first_only: bool = False) -> dict:
    """first_only: measure the first request and the same one warm, nothing else."""
    from macfleet.engine.proposers.choice import FLEET, resolve_proposer

    draft = LayerSkipModel(lm.model, layerskip)
    spec, _ = resolve_proposer("auto", lm.spec, FLEET)
    with tempfile.TemporaryDirectory(prefix="macfleet-bench-") as tmp, empty_cache():
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        t0 = time.perf_counter()
        cards = local.up(2, model=lm.spec, key=key, key_path=key_path, run_dir=Path(tmp) / "run")
        up_s = time.perf_counter() - t0
        try:
            v = next(c for c in cards if ROLE_VERIFIER in c.roles)
            p = next(c for c in cards if ROLE_PROPOSER in c.roles)
            first = dict(first_request(v, p, key, spec, max_tokens=max_tokens), up_s=round(up_s, 2),
                         cache="empty at start (MACFLEET_CACHE: a new directory)")
            if progress:
                progress(f"first request {first['first']['tokens_per_s']:.1f} tok/s, warm "
                         f"{first['warm_tokens_per_s']:.1f}: x{first['first_over_warm']:.2f}")
            if first_only:
                return {"model": lm.spec, "max_tokens": max_tokens, "first_request": first}
            res = _run(lm, prompts, draft, v, p, key, max_tokens, repeats, layerskip, k,
                       proposers, progress)
            return {**res, "first_request": first}
        finally:
            local.down(Path(tmp) / "run")


def _run(lm, prompts, draft, v, p, key, n, repeats, layerskip, k, proposers, progress) -> dict:
    ep = [p.router_endpoint]
    methods = {
        "mlx_generate_step": lambda t, ids: run_mlx_plain(lm, ids, n),
        f"mlx_speculative[layerskip:{layerskip},k={k}]":
            lambda t, ids: run_mlx_spec(lm, ids, n, draft, k),
    }
    for spec in proposers:
        methods[f"macfleet_local[{spec}]"] = (
            lambda t, ids, spec=spec: run_macfleet(lm, ids, n, spec, "auto"))
    methods["agent_alone"] = lambda t, ids: _remote(v, key, t, n, [], "none", False)
    for spec in proposers:
        for cr in (False, True):
            methods[f"agents[{spec},{'cross-round' if cr else 'no cross-round'}]"] = (
                lambda t, ids, spec=spec, cr=cr: _remote(v, key, t, n, ep, spec, cr))
    out = {}
    for pname, text in prompts.items():
        ids = encode_prompt(lm.tokenizer, text, chat=True)
        tps: dict[str, list[float]] = {m: [] for m in methods}
        info: dict[str, dict] = {}
        ref = None
        for _ in range(repeats):
            for m, fn in methods.items():
                r = fn(text, ids)
                if isinstance(r, GenerateDone):
                    toks, st = r.token_ids, r.stats
                    tps[m].append(st.decode_tokens_per_s)
                    info[m] = {k2: round(v, 4) for k2, v in _figures(st).items()}
                else:
                    toks, secs = r[0], r[1]
                    tps[m].append((len(toks) - 1) / secs if m.startswith("mlx") else
                                  len(toks) / secs)
                    if len(r) > 2:
                        info[m] = {"acceptance": round(r[2].acceptance, 4),
                                   "mean_accepted": round(r[2].mean_accepted, 4)}
                ref = ref if ref is not None else list(toks)
                info.setdefault(m, {})["identical_to_plain"] = list(toks) == ref
                if progress:
                    progress(f"{pname} {m}: {tps[m][-1]:.1f} tok/s")
        base = median(tps["mlx_generate_step"])
        spec_base = median(tps[f"mlx_speculative[layerskip:{layerskip},k={k}]"])
        alone = median(tps["agent_alone"])
        out[pname] = {"methods": {m: {
            "tokens_per_s": round(median(x), 2),
            "ratio_to_mlx_generate_step": round(median(x) / base, 3),
            "ratio_to_mlx_speculative": round(median(x) / spec_base, 3),
            "ratio_to_agent_alone": round(median(x) / alone, 3),
            **info.get(m, {})} for m, x in tps.items()}}
    return {"model": lm.spec, "max_tokens": n, "repeats": repeats, "prompts": out,
            "notes": "agents are pinned one core each (2-core machine); in-process methods use "
                     "both cores, so compare agent rows with agent_alone"}
