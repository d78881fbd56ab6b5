"""The embedded model end to end: a served greedy answer equals `macfleet generate --local
--proposer none` (the verifier decoding alone), also when several clients ask at once."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from serve_testkit import SMOLLM2_SYSTEM

QUESTIONS = ("What is the capital of France?",
             "Write one sentence about cats.")
MAX_TOKENS = 12


def _generate_alone(q: str) -> str:
    """What `macfleet generate Q --local --proposer none` prints, decoded in this process: the
    CLI's own loop (cmd_generate.py calls generate_local; the CLI itself: tests/cli), without
    a second smollm2 load in a subprocess per question."""
    from macfleet.engine.models import load_model
    from macfleet.engine.text import TextDelta
    from reference_loops import generate_local

    return "".join(e.text for e in generate_local(load_model("smollm2"), q, proposer="none",
                                                  max_tokens=MAX_TOKENS)
                   if isinstance(e, TextDelta))


@pytest.mark.slow
def test_served_answers_equal_generate_alone(smollm2_server):
    """On the shared server (conftest.py): its template with SMOLLM2_SYSTEM first renders the
    prompt the model's own template gives `generate`."""
    s = smollm2_server
    import openai  # ~1.6 s an import, not paid by the fast lane's collection

    c = openai.OpenAI(base_url=s.v1, api_key=s.key, timeout=120, max_retries=0)

    def ask(q: str) -> str:
        return c.chat.completions.create(
            model="smollm2", messages=[SMOLLM2_SYSTEM, {"role": "user", "content": q}],
            max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content

    with cf.ThreadPoolExecutor(len(QUESTIONS)) as ex:
        together = list(ex.map(ask, QUESTIONS))
    assert together == [_generate_alone(q) for q in QUESTIONS]
