"""Three arms interleaved in one process, one raw-token prompt (no chat template): the plain loop
(speculative_generate, no drafter), the serving engine with its step ahead, and without it.
python results/one-path/ahead.py MODEL TOKENS REPEATS  (PLEN=n: a prompt of n tokens).
The loop is now the tests' reference (tests/reference_loops.py, issue 49), which reads each
block back: no longer the pipelined loop this script first measured."""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY
from reference_loops import speculative_generate
from macfleet.engine.verifier import Verifier
from macfleet.serve.engine import BatchEngine, EngineRequest
lm = load_model(sys.argv[1])
N = int(sys.argv[2]); R = int(sys.argv[3])
engs = {a: BatchEngine(lm, proposer="none", max_active=1, step_ahead=a) for a in (True, False)}
import os
prompt = tuple(i % 50 + 5 for i in range(int(os.environ.get("PLEN", 35))))
def run(a):
    t0, c0 = time.perf_counter(), time.process_time()
    if a == "loop":
        list(speculative_generate(Verifier(lm.model), None, prompt, max_tokens=N))
    else:
        e = engs[a]; out = []
        e.submit(EngineRequest(prompt, GREEDY, N), out.append); e.run_until_idle()
    return time.perf_counter() - t0, time.process_time() - c0
arms = ["loop", True, False]
for a in arms: run(a)
tot = {a: [0, 0] for a in arms}
for r in range(R):
    for a in (arms if r % 2 == 0 else arms[::-1]):
        w, c = run(a); tot[a][0] += w; tot[a][1] += c
for a in arms:
    print(f"{'loop' if a == 'loop' else 'engine ahead' if a else 'engine sync'}: {1e3*tot[a][0]/N/R:.2f} wall ms/tok {1e3*tot[a][1]/N/R:.2f} cpu ms/tok")
