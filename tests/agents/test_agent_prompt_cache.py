"""The verifier agent's continuous batch keeps a prompt cache too (issue 32): a request whose
prompt starts like an earlier one's prompt and answer prefills only the rest, same answer.

Token ids: "greedy margin" (tests/tolerance.py): a cached prefix holds the keys an earlier
forward computed in another chunk shape."""

from __future__ import annotations

from agents.daemon import Agent, AgentConfig
from remote_gen import generate_done

KEY = b"k" * 32
MODEL = "tiny:3"
PROMPT = "the cat sat on the mat and looked at the dog"


def test_the_verifier_agents_batch_reuses_a_finished_requests_kv():
    ver = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False))
    try:
        first = generate_done(ver.card, KEY, PROMPT, [], "none", max_tokens=16)
        view = ver.verifier.batch_view()
        assert view.prompt_cache is not None and view.prompt_cache.hits == 0
        again = generate_done(ver.card, KEY, PROMPT, [], "none", max_tokens=16)
        longer = generate_done(ver.card, KEY, PROMPT + " again", [], "none", max_tokens=8)
        pc = ver.verifier.batch_view().prompt_cache
    finally:
        ver.close()
    assert again.token_ids == first.token_ids
    assert pc.hits == 2 and pc.saved_tokens >= 2 * (len(PROMPT) - 1)
    assert len(longer.token_ids) == 8
