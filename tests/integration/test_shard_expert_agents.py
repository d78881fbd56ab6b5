"""A MoE verifier made of expert-parallel shard agents (`macfleet up --shard 2 --shard-mode
expert --model tiny-moe:1`): the ranks form their ring from Zeroconf cards, rank 0 serves as the
verifier, a proposer agent drafts for it; greedy ids equal the single-process model's, and the
generation's stats carry the shard flow and the router's load (what `generate --json` prints)."""

from __future__ import annotations

import pytest

from bridge.card import ROLE_PROPOSER, ROLE_SHARD, ROLE_VERIFIER
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
MODEL = "tiny-moe:1"
PROMPT = "one two three, one two three, one two three,"


def test_expert_sharded_verifier_agents(tmp_path):
    key = keygen(tmp_path / "k")
    run_dir = tmp_path / "run"
    cards = local.up(2, model=MODEL, key=key, key_path=tmp_path / "k", run_dir=run_dir,
                     shard=2, shard_mode="expert", timeout_s=180, tied=True)
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
        sh = done.stats.fleet.shard
        assert sh is not None and sh.mode == "expert" and sh.ranks == 2
        assert sh.forwards > 0 and sh.collective_bytes == 4 * sh.tokens * 64 * 4
        assert sum(sh.rank_load) == sum(sh.expert_load) == 4 * sh.tokens * 2
        js = done.stats.to_dict()["fleet"]["shard"]
        assert js["rank_load"] == list(sh.rank_load) and js["bytes_per_forward"] > 0
    finally:
        local.down(run_dir)
