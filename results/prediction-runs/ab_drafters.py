"""A/B of prediction drafters on the bench's requests, in one process (issue 43).

The bench's requests (bench/serve_prediction.py; `--lines 40 --max-tokens 256`) of smollm2
through the serving engine as `serve --local` runs it (BatchEngine, the n-gram drafter beside
the prediction, greedy), without a prediction (`none`) and with it under each drafter given
(`--variants name=path`: a copy of engine/proposers/prediction.py, e.g. `git show
REV:macfleet/engine/proposers/prediction.py > old.py`), in one process, interleaved.

--clock fixed: the engine's clock is moved only by the measured verify(L) table (each forward
by verify(its tokens)), so every adaptive length follows the drafting logic alone and the runs
are deterministic: `cost` is the table's time of all the run's forwards. --clock real: the
engine's own clock; `--repeats N` runs of each, in rotating order; wall and CPU seconds.

Per request and drafter: verifier steps, positions verified, the prediction's tokens
(accepted, rejected), and (with --clock fixed) the blocks that committed >= 8 tokens (where
the answer copied the prediction) against the rest (where it did not): the rest's cost
bounds what any drafter of the prediction can gain, `bound` = the run's cost without a
prediction over that rest.

    PYTHONPATH=. python results/prediction-runs/ab_drafters.py --workloads copy --plain \\
        --variants old=old.py,new=macfleet/engine/proposers/prediction.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import macfleet.engine.verify_costs as vc
import macfleet.serve.engine as engine_mod
from macfleet.bench.serve_prediction import requests
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY
from macfleet.engine.text import encode_prompt
from macfleet.engine.tree_budget import VerifyCurve
from macfleet.engine.verify_costs import verify_costs
from macfleet.serve.engine import BatchEngine, EngineRequest

COPIED = 8  # a block that committed this many tokens copied the prediction


def load_variant(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m.PredictionProposer


class TableClock:
    def __init__(self, curve: VerifyCurve) -> None:
        self.t, self.curve = 0.0, curve

    def __call__(self) -> float:
        return self.t


def run(lm, curve, prompt, pred, max_tokens, cls, fixed: bool) -> dict:
    clock = TableClock(curve) if fixed else None
    real = engine_mod.flat_outputs

    def timed(model, segs, **kw):
        clock.t += curve.cost(sum(len(s.tokens) for s in segs)) / 1e3
        return real(model, segs, **kw)

    if fixed:
        engine_mod.flat_outputs = timed
    engine_mod.PredictionProposer = cls
    blocks, toks, done = [], [], []

    def emit(ev):
        if isinstance(ev, TokensCommitted):
            toks.extend(ev.tokens)
        elif isinstance(ev, Finished):
            done.append(ev)
        elif isinstance(ev, BlockDone):
            blocks.append((ev.drafted, ev.committed))

    try:
        eng = BatchEngine(lm, proposer="ngram", **({"clock": clock} if fixed else {}))
        w0, c0 = time.perf_counter(), time.process_time()
        eng.submit(EngineRequest(prompt, GREEDY, max_tokens, lm.eos_ids, report_blocks=True,
                                 prediction=pred), emit)
        eng.run_until_idle()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    finally:
        engine_mod.flat_outputs = real
    st = done[0].stats
    out = {"tokens": tuple(toks), "steps": st.blocks, "pred": list(st.prediction_tokens),
           "positions": sum(d + 1 for d, _ in blocks), "wall": round(wall, 3),
           "cpu": round(cpu, 3)}
    if fixed:
        cost = lambda bs: sum(curve.cost(d + 1) for d, _ in bs) / 1e3  # noqa: E731
        copied = [b for b in blocks if b[1] >= COPIED]
        rest = [b for b in blocks if b[1] < COPIED]
        out.update(cost=round(clock.t, 3), decode_cost=round(cost(blocks), 3),
                   copied_blocks=len(copied), copied_tokens=sum(c for _, c in copied),
                   copied_cost=round(cost(copied), 3), rest_blocks=len(rest),
                   rest_tokens=sum(c for _, c in rest), rest_cost=round(cost(rest), 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="copy")
    ap.add_argument("--files", default="")
    ap.add_argument("--variants", default="", help="name=path,... (prediction.py copies)")
    ap.add_argument("--plain", action="store_true", help="also without a prediction")
    ap.add_argument("--clock", choices=("fixed", "real"), default="fixed")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    lm = load_model("smollm2")
    tok = lm.tokenizer
    table = {int(k): v for k, v in verify_costs(lm.model).items()}
    # every engine seeded with the same table (no probe between runs)
    vc.known_verify_costs = lambda model, **kw: dict(table)
    engine_mod.verify_costs = lambda model, **kw: dict(table)
    curve = VerifyCurve()
    curve.seed(table)
    variants = {n: load_variant(p, "prediction_" + n) for n, p in
                (item.split("=") for item in a.variants.split(",") if item)}
    fixed = a.clock == "fixed"
    names = (["none"] if a.plain else []) + list(variants)
    print(f"smollm2, n-gram beside the prediction, --lines {a.lines} --max-tokens "
          f"{a.max_tokens}, clock {a.clock}, {a.repeats} run(s) each, interleaved", flush=True)
    rows = []
    for req in requests(a.lines, tuple(a.workloads.split(","))):
        if a.files and req["file"] not in a.files.split(","):
            continue
        prompt = tuple(encode_prompt(tok, req["ask"], True) if req["endpoint"] == "chat"
                       else tok.encode(req["ask"]))
        given = (None if req["prediction"] is None else
                 tuple(int(t) for t in tok.encode(req["prediction"], add_special_tokens=False)))
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for i in range(a.repeats):
            order = names[i % len(names):] + names[:i % len(names)]
            for n in order:
                pred = () if n == "none" else given
                if pred is None:  # regenerate: the answer without a prediction
                    pred = runs["none"][0]["tokens"]
                runs[n].append(run(lm, curve, prompt, pred, a.max_tokens,
                                   variants.get(n, engine_mod.PredictionProposer), fixed))
        answers = {r["tokens"] for rs in runs.values() for r in rs}
        row = {"file": req["file"], "workload": req["workload"], "same_answer": len(answers) == 1}
        line = f"{req['file']} {req['workload']} (same answer: {len(answers) == 1})"
        for n, rs in runs.items():
            r = {k: v for k, v in rs[0].items() if k != "tokens"}
            if not fixed:
                r["walls"] = [x["wall"] for x in rs]
                r["cpus"] = [x["cpu"] for x in rs]
                r["wall"] = statistics.median(r["walls"])
                r["cpu"] = statistics.median(r["cpus"])
            row[n] = r
            t = r["cost"] if fixed else r["wall"]
            line += f"\n  {n:>6}: steps {r['steps']} positions {r['positions']} pred {r['pred']}"
            line += (f" cost {t:.2f}s" if fixed else
                     f" wall {t:.2f}s cpu {r['cpu']:.2f}s walls {r['walls']}")
            if "none" in row and n != "none":
                b = row["none"]["cost" if fixed else "wall"]
                line += f" speed-up {b / t:.3f}x"
                if fixed:
                    bound = row["none"]["cost"] / (r["cost"] - r["decode_cost"] + r["rest_cost"])
                    row[n]["bound"] = round(bound, 3)
                    line += (f"; copied {r['copied_tokens']} tokens in {r['copied_blocks']} "
                             f"blocks ({r['copied_cost']:.2f}s), the rest {r['rest_tokens']} in "
                             f"{r['rest_blocks']} ({r['rest_cost']:.2f}s): bound {bound:.3f}x")
        print(line, flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"clock": a.clock, "repeats": a.repeats, "lines": a.lines,
                       "max_tokens": a.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
