"""The embedded model end to end: a served greedy answer equals `macfleet generate --local
--proposer none` (the verifier decoding alone), also when several clients ask at once."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys

import openai
import pytest
from serve_testkit import start_server, stop_server

from macfleet.engine.models import embedded_model_path

QUESTIONS = ("What is the capital of France?",
             "Write one sentence about cats.")
MAX_TOKENS = 12


def _generate_alone(q: str) -> str:
    r = subprocess.run([sys.executable, "-m", "macfleet", "generate", q, "--local", "--proposer",
                        "none", "--max-tokens", str(MAX_TOKENS), "--json"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["text"]


@pytest.mark.slow
def test_served_answers_equal_generate_alone():
    if embedded_model_path() is None:
        pytest.skip("the embedded model is not installed")
    s = start_server(model="smollm2", key=None)
    try:
        c = openai.OpenAI(base_url=s.v1, api_key="none", timeout=120, max_retries=0)

        def ask(q: str) -> str:
            return c.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": q}],
                max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content

        with cf.ThreadPoolExecutor(len(QUESTIONS)) as ex:
            together = list(ex.map(ask, QUESTIONS))
    finally:
        stop_server(s)
    assert together == [_generate_alone(q) for q in QUESTIONS]
