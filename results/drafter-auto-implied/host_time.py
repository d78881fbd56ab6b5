"""Where auto's host time goes on chat:romeo: the group's calls timed."""
import time, collections, sys
from macfleet.engine.models import load_model
from macfleet.engine import choosing, chooser
from macfleet.engine.events import Finished
from macfleet.bench.drafter import BENCH_PROMPTS
from macfleet.serve.one import generate_one
from macfleet.engine.proposers import retrieval, ngram

T = collections.defaultdict(float); N = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally:
            T[f"{cls.__name__}.{name}"] += (time.perf_counter() - t) * 1e3; N[f"{cls.__name__}.{name}"] += 1
    setattr(cls, name, g)
for n in ("lengths", "begin", "finish", "observe", "plain_block", "_sizes", "_score_shadows", "_shadow", "_free_draft"):
    wrap(choosing.ChoosingGroup, n)
wrap(chooser.Chooser, "choose")
for m in (retrieval, ngram):
    for cname in dir(m):
        c = getattr(m, cname)
        if isinstance(c, type) and hasattr(c, "propose") and c.__module__ == m.__name__:
            wrap(c, "propose")
import os
choosing.AHEAD_RUN = int(os.environ.get("AHEAD", "3"))
lm = load_model("smollm2:dense")
prompt = sys.argv[1] if len(sys.argv) > 1 else "chat:romeo"
for spec in ("none", "auto") * int(os.environ.get("ROUNDS", "2")):
    T.clear(); N.clear()
    t = time.perf_counter()
    for ev in generate_one(lm, BENCH_PROMPTS[prompt], proposer=spec, max_tokens=96):
        if isinstance(ev, Finished): fin = ev
    wall = (time.perf_counter() - t) * 1e3
    print(spec, "wall %.0f ms" % wall, "tokens", len(fin.token_ids), "decode tok/s %.2f" % fin.stats.decode_tokens_per_s if hasattr(fin.stats, "decode_tokens_per_s") else "")
    for k, v in sorted(T.items(), key=lambda x: -x[1])[:int(os.environ.get("TOP","20"))]:
        print("   %-32s %8.1f ms  %4d calls" % (k, v, N[k]))
