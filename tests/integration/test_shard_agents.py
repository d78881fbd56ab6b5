"""A sharded verifier made of agents: the ranks form their ring from each other's Zeroconf cards,
rank 0 serves as the verifier, a proposer agent drafts for it; a rank killed -> clear error.
The agents run the tiny model: the ring, the cards and the failure are the point (SmolLM2 in
three agent processes cost most of this test's time, issue 48)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bridge.card import ROLE_PROPOSER, ROLE_SHARD, ROLE_VERIFIER
from bridge.errors import ProtocolError, TransportTimeout
from bridge.messages import GenerateDone
from macfleet.engine.events import Finished
from reference_loops import speculative_generate
from macfleet.engine.models import load_model
from macfleet.engine.text import encode_prompt
from macfleet.engine.verifier import Verifier
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(400)]
MODEL = "tiny:1"
PROMPT = "summarize, reusing its wording: the cat sat on the mat, and the dog sat on the rug."


def test_pipeline_sharded_verifier_agents(tmp_path):
    key = keygen(tmp_path / "k")
    run_dir = tmp_path / "run"
    cards = local.up(2, model=MODEL, key=key, key_path=tmp_path / "k", run_dir=run_dir, shard=2,
                     shard_mode="pipeline", timeout_s=180, tied=True)
    try:
        v = next(c for c in cards if ROLE_VERIFIER in c.roles)
        p = next(c for c in cards if ROLE_PROPOSER in c.roles)
        assert ROLE_SHARD in v.roles and sum(ROLE_SHARD in c.roles for c in cards) == 2
        lm = load_model(MODEL)
        ids = encode_prompt(lm.tokenizer, PROMPT, chat=False)
        ref = [e for e in speculative_generate(Verifier(lm.model), None, ids, max_tokens=16,
                                               eos_ids=lm.eos_ids) if isinstance(e, Finished)]
        done = [m for m in generate_remote(v, key, prompt=PROMPT, max_tokens=16, chat=False,
                                           proposers=[p.router_endpoint], proposer_spec="ngram")
                if isinstance(m, GenerateDone)][0]
        assert done.token_ids == list(ref[0].token_ids)
        follower = next(a for a in local.read_state(run_dir)
                        if a.role == "shard" and a.name != "shard-0")
        os.kill(follower.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((ProtocolError, TransportTimeout)) as e:
            list(generate_remote(v, key, prompt=PROMPT, max_tokens=16, proposers=[],
                                 proposer_spec="none", first_token_timeout_s=5))
        assert time.monotonic() - t0 < 6
        if isinstance(e.value, ProtocolError):
            assert e.value.code in ("unavailable", "timeout")
    finally:
        local.down(run_dir)

