"""Several concurrent sessions through a local two-agent pair fleet: the verifier agent (the
pair bench's wide SmolLM2, its continuous batch) pinned to core 0, a draft agent (`--draft
smollm2:dense`) on core 1, as `bench pair`'s two-agent runs, but N requests at once. Prints,
for the verifier agent alone (`none`) and drafted ahead (`draft`), the tokens of every answer
over the wall time of the whole round, and whether the answers are the same.

    python results/draft-together/fleet_sessions.py SESSIONS TOKENS [ROUNDS] [VERIFIER_DIR]

Run from a tree on PYTHONPATH: the agents are that tree's (they inherit the environment).
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
from bridge.messages import GenerateDone
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen

QUESTIONS = ["Explain how a bicycle stays upright.", "Write a short poem about rain.",
             "What is the capital of France and why?", "List three uses of copper.",
             "Describe a sunrise over the sea.", "How do vaccines work?",
             "Give me a recipe for pancakes.", "Why is the sky blue?"]


def main() -> None:
    n, tokens = int(sys.argv[1]), int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    verifier = sys.argv[4] if len(sys.argv) > 4 else str(
        Path.home() / ".cache/macfleet/pair/w6144-x0-eps0.0-s0-f1")
    with tempfile.TemporaryDirectory(prefix="macfleet-sessions-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        cards = local.up(2, model=verifier, key=key, key_path=key_path, run_dir=Path(tmp) / "run",
                         pin=True, extra_args={"proposer": ["--draft", "smollm2:dense"]},
                         timeout_s=900, tied=True)
        try:
            ver = next(c for c in cards if ROLE_VERIFIER in c.roles)
            prop = next(c for c in cards if ROLE_PROPOSER in c.roles)

            def ask(text: str, spec: str, out: list) -> None:
                for m in generate_remote(ver, key, prompt=text, chat=True, max_tokens=tokens,
                                         proposers=[prop.router_endpoint] if spec != "none"
                                         else [], proposer_spec=spec, draft_tokens="auto",
                                         first_token_timeout_s=600):
                    if isinstance(m, GenerateDone):
                        out.append(m)

            def round_of(spec: str) -> tuple[float, list[GenerateDone]]:
                outs = [[] for _ in range(n)]
                threads = [threading.Thread(target=ask, args=(QUESTIONS[i % len(QUESTIONS)],
                                                              spec, outs[i]))
                           for i in range(n)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return time.perf_counter() - t0, [o[0] for o in outs]

            round_of("draft")  # first contact: sessions opened, shapes compiled
            ids = {}
            for r in range(rounds):
                for spec in ("none", "draft"):
                    dt, done = round_of(spec)
                    toks = sum(len(d.token_ids) for d in done)
                    drafted = sum(d.stats.drafted for d in done)
                    accepted = sum(d.stats.accepted for d in done)
                    ids.setdefault(spec, []).append([list(d.token_ids) for d in done])
                    print(f"round {r} {spec:>5}: {n} sessions, {toks} tokens in {dt:6.2f} s: "
                          f"{toks / dt:6.2f} tok/s  drafted {drafted} accepted {accepted}",
                          flush=True)
            same = all(x == ids["none"][0] for runs in ids.values() for x in runs)
            print(f"answers identical across every round and spec: {same}", flush=True)
        finally:
            local.down(Path(tmp) / "run")


if __name__ == "__main__":
    main()
