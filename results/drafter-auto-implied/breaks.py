"""chat:romeo through the serving engine, plain then auto, twice: each host read's wait (to_host, ms), `*` where the
block's step went out ahead (results/drafter-auto-implied/README.md). LD_PRELOAD=...libopenblas.so.0 python THIS"""
import time, sys
import mlx.core as mx
from macfleet.engine.models import load_model
from macfleet.bench.drafter import BENCH_PROMPTS
from macfleet.serve.one import generate_one
from macfleet.serve import decode, engine
D = []
orig = decode.to_host
def th(lazy, also=()):
    t = time.perf_counter(); r = orig(lazy, also); D.append(((time.perf_counter() - t) * 1e3, len(also))); return r
decode.to_host = th
oe = engine.BatchEngine._dispatch_ahead
A = []
def da(self, it, going):
    A.append(len(D)); return oe(self, it, going)
engine.BatchEngine._dispatch_ahead = da
lm = load_model("smollm2:dense")
for spec in ("none", "auto", "none", "auto"):
    D.clear(); A.clear()
    for ev in generate_one(lm, BENCH_PROMPTS["chat:romeo"], proposer=spec, max_tokens=96):
        pass
    print(spec, "to_host total %.0f ms" % sum(d for d, _ in D), "calls", len(D), "ahead", len(A))
    print("  ", " ".join("%.0f%s/%d" % (d, "*" if i in A else "", n) for i, (d, n) in enumerate(D[:40])))
