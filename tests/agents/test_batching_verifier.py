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


@pytest.mark.parametrize("which", ["batched", "solo"])
def test_generate_and_the_dashboard_show_the_same_multihost_overhead(agents, which):
    """One definition (macfleet.stats.multihost_overhead): for the same blocks, the figure
    `macfleet generate` prints from the run's stats record and the one the dashboard shows from
    the agent's BlockMetrics are the same, and not 0 when proposers on another agent drafted
    (the batched path used to leave it at 0.0% while the dashboard showed ~2%)."""
    import io
    import re

    from bridge.messages import BlockMetrics
    from macfleet.cli.cmd_generate import print_stats
    from macfleet.fleet.metrics import SessionMetrics
    from tui.widgets.flows import compute_summary

    prop, batched, solo = agents
    ver = batched if which == "batched" else solo
    seen, publish = [], ver.verifier.generations.publish
    ver.verifier.generations.publish = lambda m: (seen.append(m), publish(m))
    try:
        d = run(ver, PROMPTS[0], [prop.card.router_endpoint], "ngram", max_tokens=24,
                draft_tokens=3)
    finally:
        ver.verifier.generations.publish = publish
    fleet = d.stats.fleet
    assert fleet.flows.remote_blocks > 0 and fleet.wire_ms > 0
    blocks = [m for m in seen if isinstance(m, BlockMetrics) and m.session_id == d.request_id]
    sm = SessionMetrics(d.request_id, "v")
    assert 0 < len(blocks) <= sm.window  # every block of the run in the dashboard's window
    for m in blocks:
        sm.apply(m, now=0.0)
    view = sm.view(now=0.0)
    assert view.overhead_share == pytest.approx(fleet.multihost_overhead, rel=1e-9)
    assert 0 < fleet.multihost_overhead < 1
    out = io.StringIO()
    print_stats(d.stats, file=out)
    cli = re.search(r"multi-host overhead ([\d.]+%)", out.getvalue()).group(1)
    dash = re.search(r"\(overhead ([\d.]+%)\)", compute_summary(view)).group(1)
    assert cli == dash
