"""A/B of a useless prediction's per-step cost, in one process (issue 43: "no request below
0.95x when the prediction is useless").

The bench's `useless` requests (bench/serve_prediction.py: "repeat this code", another file as
the prediction), on the embedded model through the serving engine as `serve --local` runs it
(BatchEngine, the n-gram drafter, greedy), each asked without and with its prediction,
interleaved (plain, predicted, predicted, plain, ...). Per run: wall and process CPU seconds,
verifier steps, the steps whose block was a token tree (the prediction drafted), the positions
verified, the wall time of each phase of an iteration (drafting: lengths + draft_all; the
forward, whose wall is mostly the device's; accept/commit) and each decode step's process CPU.
With --fixed-clock both runs take the same blocks and are compared step by step.

    PYTHONPATH=. python results/prediction-useless/ab_step.py --repeats 1 --fixed-clock \
        > results/prediction-useless/ab_step_fixed_after.txt

What the runs found: ab_step.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import macfleet.serve.engine as engine_mod
from macfleet.bench.serve_prediction import requests
from macfleet.engine.events import Finished, TokensCommitted
from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY
from macfleet.engine.text import encode_prompt
from macfleet.engine.verify_costs import verify_costs
from macfleet.serve.engine import BatchEngine, EngineRequest


REAL = (engine_mod.read_iteration, engine_mod.flat_outputs)


class Phases:
    """Wall seconds per phase of the engine's iterations, and the verified positions."""

    def __init__(self, eng: BatchEngine, clock: "TableClock | None" = None) -> None:
        self.t = defaultdict(float)
        self.positions = self.trees = 0
        self.iters = []  # per decode iteration: (positions, a tree?, wall s, process cpu s)
        self._pos, self._tree = 0, False
        real_iter = eng._iteration

        def iteration(batch):
            self._pos, self._tree = 0, False
            t0, c0 = time.perf_counter(), time.process_time()
            real_iter(batch)
            if all(s.prefill_left <= 0 for s in batch) and self._pos:
                self.iters.append((self._pos, self._tree, time.perf_counter() - t0,
                                   time.process_time() - c0))

        eng._iteration = iteration
        self._wrap(eng.drafting, "lengths", "draft")
        self._wrap(eng.drafting, "draft_all", "draft")
        self._wrap(eng.decode, "verified", "commit")
        # the module's own functions (a later Phases wraps those, not an earlier one's)
        real_read, real_flat = REAL

        def read(run, *a, **kw):
            t0 = time.perf_counter()
            try:
                return real_read(run, *a, **kw)
            finally:
                self.t["forward"] += time.perf_counter() - t0
                for s, sl in run:
                    if not sl.prefill and s.block.tree is not None:
                        self.trees += 1
                        self._tree = True

        def flat(model, segs, **kw):
            self.positions += sum(len(s.tokens) for s in segs)
            self._pos = sum(len(s.tokens) for s in segs)
            if clock is not None:
                clock.forward(self._pos)
            t0 = time.perf_counter()
            try:
                return real_flat(model, segs, **kw)
            finally:
                self.t["forward"] += time.perf_counter() - t0

        engine_mod.read_iteration, engine_mod.flat_outputs = read, flat

    def _wrap(self, obj, name, phase):
        real = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                self.t[phase] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def reset(self):
        self.t.clear()
        self.positions = self.trees = 0
        self.iters = []


class TableClock:
    """--fixed-clock: the engine's clock moved only by its forwards, each by this machine's
    verify(L) table at its tokens (tests/serve/test_prediction.py's ForwardClock): the
    drafters' adaptive lengths then follow the drafting logic alone, so the runs with and
    without the prediction take the same blocks but where the prediction drafts, and their
    CPU seconds differ by what carrying it costs."""

    def __init__(self, table: dict[int, float]) -> None:
        from macfleet.engine.tree_budget import VerifyCurve

        self.t, self.curve = 0.0, VerifyCurve()
        self.curve.seed(table)

    def forward(self, tokens: int) -> None:
        self.t += self.curve.cost(tokens) / 1e3

    def __call__(self) -> float:
        return self.t


def run_once(eng, phases, prompt, prediction, max_tokens, eos):
    toks, done = [], []

    def emit(ev):
        if isinstance(ev, TokensCommitted):
            toks.extend(ev.tokens)
        elif isinstance(ev, Finished):
            done.append(ev)

    phases.reset()
    w0, c0 = time.perf_counter(), time.process_time()
    eng.submit(EngineRequest(prompt, GREEDY, max_tokens, eos, prediction=prediction), emit)
    eng.run_until_idle()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    st = done[0].stats
    return {"tokens": tuple(toks), "wall": wall, "cpu": cpu, "steps": st.blocks,
            "trees": phases.trees, "positions": phases.positions,
            "pred": st.prediction_tokens, "iters": list(phases.iters),
            **{k: v for k, v in phases.t.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--files", default="", help="comma-separated file names (default: all)")
    ap.add_argument("--fixed-clock", action="store_true",
                    help="the engine's clock moved by the verify(L) table only (TableClock)")
    ap.add_argument("--fresh", action="store_true",
                    help="a new engine per run (implied by --fixed-clock)")
    args = ap.parse_args()
    lm = load_model("smollm2")
    tok = lm.tokenizer
    clock = TableClock(verify_costs(lm.model)) if args.fixed_clock else None

    def fresh():
        """An engine (with --fixed-clock a new one per run: the engine's state -- its cost
        curve, the pool of recent blocks' acceptance -- is then the same at every run's start)."""
        eng = BatchEngine(lm, proposer="ngram", **({"clock": clock} if clock else {}))
        return eng, Phases(eng, clock)

    eng, phases = fresh()
    # warm-up, as the bench's (first forwards; a prediction's session reads verify(L))
    run_once(eng, phases, tuple(encode_prompt(tok, "Say hello.", True)),
             tuple(tok.encode("Hello!", add_special_tokens=False)), 4, lm.eos_ids)
    order = [False, True] + [w for i in range(1, args.repeats)
                             for w in ([True, False] if i % 2 else [False, True])]
    print(f"smollm2, proposer ngram, --lines {args.lines} --max-tokens {args.max_tokens}, "
          f"{args.repeats} runs each way, interleaved{', fixed clock' if clock else ''}"
          f"{', a new engine per run' if clock or args.fresh else ''}; "
          "a shared 2-core box (wall is noise; CPU seconds are the cost)")
    for req in requests(args.lines, ("useless",)):
        if args.files and req["file"] not in args.files.split(","):
            continue
        prompt = tuple(encode_prompt(tok, req["ask"], True))
        pred = tuple(int(t) for t in tok.encode(req["prediction"], add_special_tokens=False))
        runs = {False: [], True: []}
        for w in order:
            if clock is not None or args.fresh:
                eng, phases = fresh()
            runs[w].append(run_once(eng, phases, prompt, pred if w else (), args.max_tokens,
                                    lm.eos_ids))
        same = len({r["tokens"] for r in runs[False] + runs[True]}) == 1
        print(f"\n{req['file']}: prompt {len(prompt)} tokens, prediction {len(pred)}, "
              f"answer {len(runs[False][0]['tokens'])}, same answer: {same}")
        med = {w: {k: statistics.median(r[k] for r in rs) for k in
                   ("wall", "cpu", "steps", "trees", "positions", "draft", "forward", "commit")}
               for w, rs in runs.items()}
        for w in (False, True):
            m = med[w]
            print(f"  {'with   ' if w else 'without'}: wall {m['wall']:.2f}s cpu {m['cpu']:.2f}s"
                  f" steps {m['steps']:.0f} trees {m['trees']:.0f} positions "
                  f"{m['positions']:.0f} | per step ms: wall {1e3 * m['wall'] / m['steps']:.1f}"
                  f" draft {1e3 * m['draft'] / m['steps']:.2f} forward "
                  f"{1e3 * m['forward'] / m['steps']:.1f} commit "
                  f"{1e3 * m['commit'] / m['steps']:.2f} | prediction acc/rej "
                  f"{runs[w][0]['pred']} | walls {[round(r['wall'], 2) for r in runs[w]]}")
        by_len = defaultdict(list)  # the chain steps' CPU by positions, over every run
        for r in runs[False] + runs[True]:
            for pos, tree, _, cpu in r["iters"]:
                if not tree:
                    by_len[pos].append(cpu)
        print("  chain steps' median CPU ms by positions: " + ", ".join(
            f"{p}: {1e3 * statistics.median(c):.0f}" for p, c in sorted(by_len.items())))
        for w in (False, True):
            extra = [sum(cpu - statistics.median(by_len[pos]) for pos, tree, _, cpu in r["iters"]
                         if tree and by_len[pos]) for r in runs[w]]
            trees = [(pos, round(1e3 * cpu)) for pos, tree, _, cpu in runs[w][0]["iters"] if tree]
            steps = [len(r["iters"]) for r in runs[w]]
            cpu_step = [1e3 * sum(i[3] for i in r["iters"]) / len(r["iters"]) for r in runs[w]]
            print(f"  {'with   ' if w else 'without'}: decode steps {steps}, CPU ms a step "
                  f"{[round(c, 1) for c in cpu_step]}; tree steps' CPU over a chain step of "
                  f"their positions: {[round(e, 3) for e in extra]} s; first run's tree steps "
                  f"(positions, CPU ms): {trees}")
        # --fixed-clock: both runs take the same blocks (but where the prediction drafted), so
        # step i of one is step i of the other: the paired CPU differences are what carrying
        # the prediction costs, on its tree steps and on every other step
        for a, b in zip(runs[False], runs[True]):
            if len(a["iters"]) != len(b["iters"]):
                print(f"  (a pair of runs took {len(a['iters'])} and {len(b['iters'])} steps: "
                      "not paired step by step)")
                continue
            pairs = [(y[1], y[3] - x[3]) for x, y in zip(a["iters"], b["iters"])]
            tree = [d for t, d in pairs if t]
            chain = [d for t, d in pairs if not t]
            print(f"  paired by step, with - without CPU: the {len(tree)} tree steps "
                  f"{1e3 * sum(tree):+.0f} ms in all; the {len(chain)} other steps "
                  f"{1e3 * sum(chain):+.0f} ms in all, median {1e3 * statistics.median(chain):+.2f}"
                  f" ms a step; the run's CPU without: {1e3 * sum(x[3] for x in a['iters']):.0f}"
                  " ms")
        print(f"  speed-up (median wall) {med[False]['wall'] / med[True]['wall']:.3f}x, "
              f"cpu {med[False]['cpu'] / med[True]['cpu']:.3f}x, steps "
              f"{med[False]['steps'] / med[True]['steps']:.3f}x")


if __name__ == "__main__":
    main()
