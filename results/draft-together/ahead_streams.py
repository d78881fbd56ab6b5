"""The draft agent's drafting capacity for N sessions at once (agents/draft_service.py): the
time until every session's stream holds LEAD tokens drafted ahead, with the sessions' caches
rows of one store (drafted together, one forward a step) and without (one session a step,
round-robin, as before). Prints draft tokens a second for each, alternating.

    python results/draft-together/ahead_streams.py DRAFT_MODEL SESSIONS LEAD [ROUNDS]
"""

import sys
import time

from agents.draft_service import DraftAheadService
from bridge.messages import DraftChunk, StreamOpen
from macfleet.engine.models import load_model
from macfleet.engine.proposers.model_draft import ModelProposer
from macfleet.engine.text import encode_prompt

QUESTIONS = ["Explain how a bicycle stays upright.", "Write a short poem about rain.",
             "What is the capital of France and why?", "List three uses of copper.",
             "Describe a sunrise over the sea.", "How do vaccines work?",
             "Give me a recipe for pancakes.", "Why is the sky blue?"]


class Reply:
    """A session's replier: its chunks' tokens into `out`; each session its own client
    connection (`peer`), as verifiers' sessions are (a client holds at most 4)."""

    def __init__(self, out: list[int], sid: str) -> None:
        self.out, self.peer = out, sid.encode()

    def __call__(self, msg) -> None:
        if isinstance(msg, DraftChunk):
            self.out.extend(msg.tokens)


def run(lm, n: int, lead: int) -> tuple[float, dict]:
    svc = DraftAheadService(lm, serves="v")
    got: dict[str, list[int]] = {}
    try:
        t0 = time.perf_counter()
        for i in range(n):
            sid = f"s{i}"
            got[sid] = []
            prompt = encode_prompt(lm.tokenizer, QUESTIONS[i % len(QUESTIONS)], chat=True)
            svc.handle(StreamOpen(sid, "v", prompt, 0.0, 1.0, None, lead), Reply(got[sid], sid))
        deadline = time.perf_counter() + 600
        while any(len(v) < lead for v in got.values()):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"streams short of {lead}: {[len(v) for v in got.values()]}")
            time.sleep(0.005)
        return time.perf_counter() - t0, got
    finally:
        svc.close()


def main() -> None:
    lm = load_model(sys.argv[1])
    n, lead = int(sys.argv[2]), int(sys.argv[3])
    real = ModelProposer.share_rows
    for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 2):
        for arm in ("alone", "together"):
            ModelProposer.share_rows = real if arm == "together" else (lambda self, stores: None)
            dt, got = run(lm, n, lead)
            print(f"round {r} {arm:>8}: {n} streams x {lead} tokens in {dt:6.2f} s: "
                  f"{n * lead / dt:6.2f} draft tokens/s  ids {hash(str(sorted(got.items())))}",
                  flush=True)
    ModelProposer.share_rows = real


if __name__ == "__main__":
    main()
