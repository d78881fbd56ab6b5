"""`macfleet generate --json` through a real local fleet whose only verifier is killed mid-answer:
the tokens the client had already received are printed (with the reason), not lost.

Everything is real: two agent processes (tiny random-weight model, so the answer streams fast),
the CLI as a subprocess in fleet mode (MACFLEET_KEY), Zeroconf, ZeroMQ, the client's re-plan
(which finds no other verifier). "Mid-answer" is read off the verifier's own batch status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bridge.card import ROLE_VERIFIER
from fleetkit import local_fleet
from macfleet.fleet.client import batch_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "tiny:1"
PROMPT = "the cat sat on the mat"
MAX_TOKENS = 4000  # far more than streams before the kill
REF_TOKENS = 1000  # the in-process reference
KILL_AFTER = 12  # tokens the verifier has generated for the request before it is killed


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "macfleet", "generate", PROMPT, "--json", "--model", MODEL,
            "--no-chat", "--proposer", "ngram", "--draft-tokens", "2", *args]


def generated(card, key) -> int:
    st = batch_status(card, key, recent=0, timeout=2.0)
    assert st is not None and st.batching, "the verifier's batch cannot be read"
    return max((s.generated for s in st.sessions if s.active), default=0)


def test_tokens_received_before_the_last_verifier_died_are_printed(tmp_path):
    env = dict(os.environ)
    env.pop("MACFLEET_KEY", None)
    # the verifier alone, in-process: what the fleet's answer must be a prefix of (decoded
    # while the fleet starts)
    ref = subprocess.Popen(cli("--local", "--max-tokens", str(REF_TOKENS)), env=dict(env),
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with local_fleet(tmp_path, model=MODEL) as fleet:
            ref_out, ref_err = ref.communicate(timeout=120)
            assert ref.returncode == 0, ref_err
            want = json.loads(ref_out.strip().splitlines()[-1])
            assert len(want["token_ids"]) == REF_TOKENS
            env["MACFLEET_KEY"] = str(fleet["key_path"])
            pid = fleet["agents"][ROLE_VERIFIER].pid
            proc = subprocess.Popen(cli("--max-tokens", str(MAX_TOKENS), "--wait", "5"),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env)
            try:
                deadline = time.monotonic() + 90
                while generated(fleet["verifier"], fleet["key"]) < KILL_AFTER:
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "the answer never started streaming"
                    time.sleep(0.02)
                os.kill(pid, signal.SIGKILL)  # mid-answer: the request is far from done
                out, err = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.communicate()
    assert proc.returncode != 0, out  # a failed generation is an error...
    assert "re-planning" in err, err  # ...after the client tried the rest of the fleet
    assert out.strip(), f"nothing printed: the tokens received were lost ({err[-500:]})"
    got = json.loads(out.strip().splitlines()[-1])  # ...and what was received is printed
    assert got["complete"] is False and "verifier" in got["error"], got
    ids = got["token_ids"]
    assert KILL_AFTER // 2 <= len(ids) <= REF_TOKENS, len(ids)
    assert ids == want["token_ids"][:len(ids)]  # the verifier's own greedy answer, in order
    assert got["text"] and want["text"].startswith(got["text"])
    assert len(got["text"]) == len(ids)  # the tiny tokenizer: one character per token
