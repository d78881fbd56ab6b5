"""Per prompt: the EAGLE-2 head's own predicted acceptance (sum of the drafted tree's node
probabilities) against what each block accepted, eagle2 fixed, greedy."""
import json, sys
from macfleet.bench.drafter import BENCH_PROMPTS
from macfleet.engine.proposers.eagle import tree as T
from macfleet.engine.events import Finished
from macfleet.engine.models import load_model
from macfleet.serve.one import generate_one
rows = []
orig = T.EagleTreeProposer.observe
def observe(self, drafted, accepted, verify_ms, verified=None):
    rows.append((drafted, accepted, self._predicted, self.calibration.gain))
    orig(self, drafted, accepted, verify_ms, verified)
T.EagleTreeProposer.observe = observe
lm = load_model("smollm2")
out = {}
for kind, prompt in BENCH_PROMPTS.items():
    rows.clear()
    for ev in generate_one(lm, prompt, max_tokens=96, proposer="eagle2"):
        pass
    out[kind] = list(rows)
    d = [r for r in rows if r[0]]
    n = len(d)
    pa = sum(r[2] for r in d) / n; ac = sum(r[1] for r in d) / n
    f = d[:3]
    print(f"{kind:16s} blocks {n:3d} predicted {pa:.2f} accepted {ac:.2f}  first3 pred "
          + " ".join(f"{r[2]:.2f}" for r in f) + "  acc " + " ".join(str(r[1]) for r in f), flush=True)
json.dump(out, open('/tmp/diag/conf.json', 'w'))


# What one block says of the answer's mean acceptance (run after the above, /tmp/diag/conf.json):
# over the first ten blocks of each prompt, the realized `accepted` against the head's own
# prediction times the bench's overall gain (accepted / predicted over all blocks).
def first_block_error(path="/tmp/diag/conf.json", first=10):
    import math
    d = json.load(open(path))
    blocks = [x for rows in d.values() for x in rows if x[0]]
    g = sum(x[1] for x in blocks) / sum(x[2] for x in blocks)
    se_r = se_p = n = 0
    for rows in d.values():
        r = [x for x in rows if x[0]]
        mu = sum(x[1] for x in r) / len(r)
        for x in r[:first]:
            se_r, se_p, n = se_r + (x[1] - mu) ** 2, se_p + (g * x[2] - mu) ** 2, n + 1
    return g, math.sqrt(se_r / n), math.sqrt(se_p / n)
