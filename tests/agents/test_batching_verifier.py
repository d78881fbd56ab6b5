"""The verifier agent's continuous batch, over real sockets (tiny models, one process).

Concurrent requests to one verifier agent are verified together, one forward per iteration
over every session's speculative block, each session drafted by its own remote proposer.
Token ids: the "greedy margin" rule of tests/tolerance.py -- a session in the flat batch and
the same request on a verifier agent that runs one session at a time take different code paths.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.daemon import Agent, AgentConfig
from bridge.messages import GenerateDone
from macfleet.fleet.client import batch_status
from remote_gen import generate_done

KEY = b"k" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed
MODEL = "tiny:3"
PROMPTS = ["the cat sat on the mat", "one two three four", "hello hello hello",
           "a b a b a b", "the quick brown fox", "def f(x): return x", "lorem ipsum dolor",
           "to be or not to be"]


@pytest.fixture(scope="module")
def agents():
    prop = Agent(AgentConfig(role="proposer", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL))
    batched = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                                allow_peers=LOCAL))
    solo = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL,
                             batch_sessions=0))
    yield prop, batched, solo
    for a in (batched, solo, prop):
        a.close()


def run(ver: Agent, prompt: str, eps: list[str], spec: str, **kw) -> GenerateDone:
    return generate_done(ver.card, KEY, prompt, eps, spec, **kw)


def test_concurrent_sessions_share_forwards_and_match_one_at_a_time(agents):
    prop, batched, solo = agents
    assert batched.verifier.batching and not solo.verifier.batching
    alone = [run(solo, p, [], "none", max_tokens=24) for p in PROMPTS]
    eps = [prop.card.router_endpoint]
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(lambda p: run(batched, p, eps, "ngram", max_tokens=24,
                                        draft_tokens=3), PROMPTS))
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert [g.text for g in got] == [a.text for a in alone]
    assert all(g.stats.fleet.flows.remote_blocks > 0 for g in got)
    view = batched.verifier.batch_view()
    assert view.mode == "batched" and view.iterations > 0
    assert max(it.sessions for it in view.recent) > 1  # sessions were verified together
    assert solo.verifier.batch_view() is None
    st = batch_status(batched.card, KEY, recent=8)  # what `serve` in front of it shows
    assert st.batching and st.iterations == view.iterations and len(st.recent) == 8
    assert sorted(s.sid for s in st.sessions if s.state == "done")[-len(PROMPTS):]
    assert not batch_status(solo.card, KEY).batching


def test_a_dead_proposer_in_the_batch_falls_back_to_the_next(agents):
    prop, batched, solo = agents
    alone = run(solo, PROMPTS[0], [], "none", max_tokens=16)
    d = run(batched, PROMPTS[0], ["tcp://127.0.0.1:9", prop.card.router_endpoint], "ngram",
            max_tokens=16, draft_tokens=2)
    assert d.token_ids == alone.token_ids
    assert d.stats.fleet.proposer_failures == 1 and d.stats.fleet.flows.remote_blocks > 0


def test_concurrent_trees_are_verified_in_the_batch(agents):
    """Two remote drafters per request make a token tree: concurrent tree requests share the
    batch's forwards (each tree its own ancestor mask), ids equal to one at a time."""
    prop, batched, solo = agents
    before = batched.verifier.batch_view().iterations
    prompts = PROMPTS[:4]
    alone = [run(solo, p, [], "none", max_tokens=16) for p in prompts]
    ep = prop.card.router_endpoint
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: run(batched, p, [ep, ep], "ngram+layerskip:2",
                                        max_tokens=16, draft_tokens=2), prompts))
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    view = batched.verifier.batch_view()
    assert view.iterations > before
    assert max(it.sessions for it in view.recent) > 1
    assert all(len(g.stats.per_proposer) == 2 for g in got)
    assert all(g.stats.fleet.flows.remote_blocks > 0 for g in got)
