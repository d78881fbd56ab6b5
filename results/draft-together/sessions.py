"""N concurrent greedy requests through one BatchEngine (the serving engine `serve` runs), each
proposer spec in turn (`SPEC@R`: with stall ratio R): wall, tokens/s, drafts, iterations, and
a hash of the answers (the same for every spec: greedy is lossless).

    python sessions.py VERIFIER SPEC[,SPEC...] SESSIONS TOKENS     (ROUNDS=2 by default)
"""
import sys, time
from macfleet.engine.models import load_model
from macfleet.engine.text import encode_prompt
from macfleet.engine.sampling import GREEDY
from macfleet.engine.events import Finished
from macfleet.serve.engine import BatchEngine, EngineRequest

ver = load_model(sys.argv[1])
props = sys.argv[2].split(",")
n = int(sys.argv[3]); tokens = int(sys.argv[4])
qs = ["Explain how a bicycle stays upright.", "Write a short poem about rain.",
      "What is the capital of France and why?", "List three uses of copper.",
      "Describe a sunrise over the sea.", "How do vaccines work?",
      "Give me a recipe for pancakes.", "Why is the sky blue?"]
prompts = [encode_prompt(ver.tokenizer, q, chat=True) for q in qs[:n]]
for rnd in range(int(__import__("os").environ.get("ROUNDS", "2"))):
    for p in props:
        p, _, sr = p.partition("@")
        eng = BatchEngine(ver, proposer=p, max_active=8,
                          **({"stall_ratio": float(sr)} if sr else {}))
        done = {}
        t0 = time.perf_counter()
        for i, pr in enumerate(prompts):
            eng.submit(EngineRequest(tuple(pr), GREEDY, tokens, eos_ids=ver.eos_ids),
                       lambda ev, i=i: done.__setitem__(i, ev) if isinstance(ev, Finished) else None)
        eng.run_until_idle()
        dt = time.perf_counter() - t0
        toks = sum(len(f.token_ids) for f in done.values())
        acc = sum(f.stats.accepted for f in done.values()); dr = sum(f.stats.drafted for f in done.values())
        print(f"round {rnd} {p+sr:>12}: {dt:6.2f} s  {toks/dt:6.2f} tok/s  drafted {dr} accepted {acc} iters {eng.iterations}", flush=True)
        if rnd == 1: print("   ids", hash(tuple(tuple(done[i].token_ids) for i in sorted(done))))
