"""A/B, interleaved in one process: one request through the serving engine's own-forward mode
(a model the flat batch cannot run: a random OLMo2) against the reference chain loop
(tests/reference_loops.py); CPU seconds per request, median of 5 rounds after a warm-up.
Run from the repository root: PYTHONPATH=. python results/one-path/own_forward_ab.py"""
import sys, time, statistics
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/engine")
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import olmo2
from macfleet.engine.events import Finished
from macfleet.engine.proposers import make_proposer
from macfleet.engine.controller import make_controller
from macfleet.engine.verifier import Verifier
from macfleet.serve.one import decode_ids
from reference_loops import speculative_generate
mx.random.seed(0)
args = olmo2.ModelArgs(model_type="olmo2", hidden_size=512, num_hidden_layers=6, intermediate_size=1536,
    num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=4096,
    max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True)
model = olmo2.Model(args); model.update(tree_map(lambda p: p * 3.0, model.parameters())); mx.eval(model.parameters()); model.eval()
class LM:
    vocab_size, tokenizer, eos_ids, spec = 4096, None, frozenset(), "olmo2-random"
    def __init__(self, m): self.model = m
lm = LM(model)
prompt = [5, 17, 33, 2, 9, 41, 5, 17, 33, 2, 9, 41] * 4
N = 64
def fin(ev): return [e for e in ev if isinstance(e, Finished)][0]
def eng(spec):
    return fin(decode_ids(lm, prompt, make_proposer(spec, lm), draft_tokens=4 if spec != "none" else 0, max_tokens=N, eos_ids=frozenset()))
def loop(spec):
    p = make_proposer(spec, lm)
    return fin(speculative_generate(Verifier(model), p, prompt, max_tokens=N, controller=make_controller(4 if p else 0)))
res = {}
for r in range(6):
    for spec in ("none", "ngram"):
        for name, fn in (("engine", eng), ("loop", loop)):
            t0 = time.process_time(); f = fn(spec); dt = time.process_time() - t0
            if r: res.setdefault((spec, name), []).append(dt)
            ids = res.setdefault(("ids", spec, name), f.token_ids)
            assert ids == f.token_ids
for spec in ("none", "ngram"):
    e, l = statistics.median(res[(spec, "engine")]), statistics.median(res[(spec, "loop")])
    print(f"{spec}: engine {e:.3f} cpu-s, loop {l:.3f} cpu-s, loop/engine cpu = {l/e:.3f}; same ids: {res[('ids', spec, 'engine')] == res[('ids', spec, 'loop')]}")
