"""Side-by-side drafter figures in one process: acceptance, draft cost, end-to-end speed.

    python -m macfleet.engine.drafter.bench [--model smollm2] [--max-tokens 48] [--out PATH]

For each chat prompt, every proposer runs in turn (interleaved, so a busy shared CPU slows all
of them alike) with a fixed draft length k=4 and greedy decoding; each run is checked
bit-identical to the verifier alone. Writes results/drafter.json with the command line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

from macfleet.engine.controller import FixedDraftLength
from macfleet.engine.events import Finished
from macfleet.engine.loop import speculative_generate
from macfleet.engine.models import load_model
from macfleet.engine.proposers.factory import make_proposer
from macfleet.engine.text import encode_prompt
from macfleet.engine.verifier import Verifier

PROMPTS = ("Explain how a bicycle works.",
           "Write a Python function that returns the factorial of n.",
           "What are three good habits for staying healthy?")
PROPOSERS = ("none", "eagle", "eagle@int8", "eagle@auto", "layerskip:20", "ngram")
K = 4


def verifier_step_ms(lm, prompt: list[int], n: int = 12) -> float:
    """Median wall time of one verifier decode step (a forward over 1 token)."""
    v = Verifier(lm.model)
    v.prefill(prompt[:-1])
    times, tok = [], prompt[-1]
    for _ in range(n):
        t0 = time.perf_counter()
        logits = v.forward([tok])
        tok = int(mx.argmax(logits[-1]).item())
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _proposer(spec: str, lm):
    """`eagle@int8`: the head fed features that went through the int8 F3 codec (what a
    proposer on another Mac sees with --f3-codec int8); `X@auto`: adaptive draft length."""
    from macfleet.engine.controller import make_controller

    base, _, opt = spec.partition("@")
    prop = make_proposer(base, lm)
    if opt == "int8":
        prop.f3_codec = "int8"
    ctl = make_controller("auto") if opt == "auto" else FixedDraftLength(K if prop else 0)
    return prop, ctl


def run(model: str, max_tokens: int, proposers=PROPOSERS, prompts=PROMPTS) -> dict:
    lm = load_model(model)
    rows: dict[str, list[dict]] = {p: [] for p in proposers}
    step_ms = []
    for q in prompts:
        ids = encode_prompt(lm.tokenizer, q, chat=True)
        step_ms.append(verifier_step_ms(lm, ids))
        ref = None
        for spec in proposers:
            prop, ctl = _proposer(spec, lm)
            evs = list(speculative_generate(Verifier(lm.model), prop, ids,
                                            max_tokens=max_tokens, eos_ids=lm.eos_ids,
                                            controller=ctl))
            fin = evs[-1]
            assert isinstance(fin, Finished)
            ref = fin.token_ids if ref is None else ref
            d = fin.stats.to_dict()
            d["identical_to_verifier_alone"] = fin.token_ids == ref
            d["prompt"] = q
            rows[spec].append(d)
    vstep = sorted(step_ms)[len(step_ms) // 2]
    summary = {}
    for spec, rs in rows.items():
        drafted = sum(r["drafted"] for r in rs)
        accepted = sum(r["accepted"] for r in rs)
        hist = [0] * 8
        for r in rs:
            for i, c in enumerate(r["accepted_hist"]):
                hist[i] += c
        nblk = sum(hist)
        tokens = sum(r["tokens"] for r in rs)
        decode_s = sum(r["elapsed_s"] - r["prefill_ms"] / 1e3 for r in rs)
        summary[spec] = {
            "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_per_block": (sum(i * c for i, c in enumerate(hist)) / nblk
                                        if nblk else None),
            "draft_ms_per_token": sum(r["draft_ms"] for r in rs) / drafted if drafted else None,
            "draft_cost_vs_verifier_step": (sum(r["draft_ms"] for r in rs) / drafted / vstep
                                            if drafted else None),
            "decode_tokens_per_s": tokens / decode_s,
            "all_identical": all(r["identical_to_verifier_alone"] for r in rs),
        }
    base = summary["none"]["decode_tokens_per_s"] if "none" in summary else None
    for s in summary.values():
        s["speedup_vs_none"] = s["decode_tokens_per_s"] / base if base else None
    return {"model": model, "k": K, "max_tokens": max_tokens, "greedy": True,
            "verifier_step_ms": vstep, "summary": summary, "runs": rows,
            "host": f"{platform.system()} {platform.machine()}, shared CPU"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m macfleet.engine.drafter.bench")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--proposers", nargs="+", default=list(PROPOSERS),
                    help="proposer specs; the first should be none (the baseline)")
    ap.add_argument("--out", default="results/drafter.json")
    a = ap.parse_args(argv)
    res = run(a.model, a.max_tokens, tuple(a.proposers))
    res["command"] = "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python3 -m " \
                     "macfleet.engine.drafter.bench " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    for spec, s in res["summary"].items():
        print(f"{spec:14s} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
