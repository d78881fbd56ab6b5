import sys, time, statistics as st
from macfleet.engine.models import load_model
from macfleet.serve.one import generate_one
from macfleet.serve import engine as engine_mod
from macfleet.engine.events import Finished
from macfleet.bench.drafter import BENCH_PROMPTS
lm = load_model("smollm2")
real = engine_mod.steps_ahead
from macfleet.engine import chooser as ch
from macfleet.stats import DrafterChoice, BEST
real_choose = ch.Chooser.choose
def forced(self, sizes=None):
    real_choose(self, sizes)
    self._last = DrafterChoice(self.block, "none", BEST, 0.0)
    return self._last
def run(spec, ahead, prompt):
    engine_mod.steps_ahead = real if ahead else (lambda *a, **k: ())
    ch.Chooser.choose = forced if spec == "auto-forced" else real_choose
    spec = "auto" if spec == "auto-forced" else spec
    t0 = time.perf_counter(); c0 = time.process_time()
    for ev in generate_one(lm, BENCH_PROMPTS[prompt], proposer=spec, max_tokens=96):
        if isinstance(ev, Finished): fin = ev
    return fin.stats.tokens / (time.perf_counter() - t0), time.process_time() - c0, fin.token_ids
arms = [("none", True), ("none", False), ("auto", True), ("auto-forced", True)]
res = {a: [] for a in arms}
prompt = sys.argv[1]
run("none", True, prompt)  # warm
for r in range(int(sys.argv[2])):
    for a in (arms if r % 2 == 0 else arms[::-1]):
        tps, cpu, ids = run(*a, prompt)
        res[a].append(tps)
        print(r, a, round(tps, 2), round(cpu, 2), flush=True)
base = st.median(res[("none", True)])
for a, v in res.items():
    print(a, [round(x, 2) for x in v], "median ratio vs plain(ahead)", round(st.median(v) / base, 3))
