"""`macfleet up` then `macfleet generate --proposer auto` (issue 44), all real: two agent
processes (tiny model), Zeroconf on 127.0.0.1, the CLI as a subprocess in fleet mode. The
verifier agent chooses the drafter of each block among its own drafters (no proposer agent
named), with the answer of the verifier alone (`--proposer none`; token ids: the "greedy
margin" rule of tests/tolerance.py); a named drafter still drafts on the proposer agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleetkit import local_fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "tiny:1"
PROMPT = "a b a b a b a b"


def generate(env: dict, proposer: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "macfleet", "generate", PROMPT, "--json", "--model", MODEL,
         "--no-chat", "--proposer", proposer, "--max-tokens", "32", "--wait", "3"],
        capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_auto_through_a_local_fleet_is_chosen_on_the_verifier(tmp_path):
    env = dict(os.environ)
    with local_fleet(tmp_path, model=MODEL) as fleet:
        env["MACFLEET_KEY"] = str(fleet["key_path"])
        plain, auto, ngram = (generate(env, p) for p in ("none", "auto", "ngram"))
    assert auto["token_ids"] == plain["token_ids"] == ngram["token_ids"]
    st, where = auto["stats"], auto["stats"]["where"]
    assert where["mode"] == "fleet" and where["verifier"] == fleet["verifier"].name
    assert st["proposer"] == "auto" and not where["proposers"]
    assert len(st["choices"]) == st["blocks"] and all(c["drafter"] for c in st["choices"])
    assert ngram["stats"]["where"]["proposers"] == [fleet["proposer"].name]
    assert ngram["stats"]["fleet"]["flows"]["remote_blocks"] > 0
