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


def test_the_verifier_agents_cache_is_partitioned_as_serve_asks():
    """A serve of several API keys sends each key's partition (issue 47): another partition's
    request for the same prompt reuses nothing; the same partition's does."""
    ver = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False))
    try:
        def cached(part: str) -> int:
            return generate_done(ver.card, KEY, PROMPT, [], "none", max_tokens=8,
                                 cache_partition=part).cached_tokens

        got = [cached("alice"), cached("bob"), cached(""), cached("alice")]
    finally:
        ver.close()
    assert got[:3] == [0, 0, 0] and got[3] > 0, got
