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
from bridge.messages import GenerateChunk, GenerateDone
from macfleet.fleet.client import batch_status, generate_remote
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


@pytest.mark.slow
def test_concurrent_sessions_share_forwards_and_match_one_at_a_time(agents):
    prop, batched, solo = agents
    assert batched.verifier.batch_view() is not None and solo.verifier.batch_view() is None
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


def test_the_verifier_agent_alone_steps_ahead(agents, monkeypatch):
    """`--proposer none` through a batching verifier agent (what a fleet's speedup is measured
    against): its plain steps go out one iteration ahead, as in `serve`, the same answer as
    one session at a time."""
    from macfleet.serve import engine as engine_mod

    prop, batched, solo = agents
    went, real = [], engine_mod.steps_ahead
    monkeypatch.setattr(engine_mod, "steps_ahead",
                        lambda *a, **kw: went.append(real(*a, **kw)) or went[-1])
    alone = run(solo, PROMPTS[1], [], "none", max_tokens=16)  # (a batch of one: ahead too)
    went.clear()
    assert run(batched, PROMPTS[1], [], "none", max_tokens=16).token_ids == alone.token_ids
    assert sum(bool(g) for g in went) >= 10  # (the steps ahead: all but the last few)


@pytest.mark.slow
def test_a_dead_proposer_in_the_batch_falls_back_to_the_next(agents):
    prop, batched, solo = agents
    alone = run(solo, PROMPTS[0], [], "none", max_tokens=16)
    d = run(batched, PROMPTS[0], ["tcp://127.0.0.1:9", prop.card.router_endpoint], "ngram",
            max_tokens=16, draft_tokens=2)
    assert d.token_ids == alone.token_ids
    assert d.stats.fleet.proposer_failures == 1 and d.stats.fleet.flows.remote_blocks > 0


@pytest.mark.slow
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


def _streamed(ver: Agent, prompt: str, **kw) -> tuple[GenerateDone, list, list, list]:
    """The GenerateDone and what the chunks carried: ids, logprobs, alternatives."""
    done, ids, lps, top = None, [], [], []
    for m in generate_remote(ver.card, KEY, prompt=prompt, chat=False, proposer_spec="none",
                             **kw):
        if isinstance(m, GenerateChunk):
            ids += m.token_ids
            lps += m.logprobs
            top += m.top
        elif isinstance(m, GenerateDone):
            done = m
    assert done is not None and ids == done.token_ids
    return done, ids, lps, top



WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,4}"


@pytest.mark.parametrize("forward", ["flat", "own"])
def test_logprobs_and_a_grammar_on_one_session_match_the_batch(agents, monkeypatch, forward):
    """A verifier that decodes one session at a time (--batch-sessions 0, or sharded) runs the
    serving engine too, so it serves top_logprobs and response_format: the same request gives
    the batched agent's ids and alternatives, and the answer matches the grammar. flat: a flat
    batch of one, "same path" floats, so logprobs are equal; own: the session on the
    verifier's own forward (a sharded verifier, a model the flat batch cannot run), the
    engine's batch-invariant mode: "greedy margin", logprobs within tests/tolerance.py."""
    import re

    import agents.verifier_generate as vg
    from tolerance import LOGPROB_ATOL, LOGPROB_RTOL

    prop, batched, solo = agents
    if forward == "own":
        monkeypatch.setattr(vg, "supports_tree_attention", lambda model: False)
    engines, one_engine = [], vg.one_engine
    monkeypatch.setattr(vg, "one_engine", lambda *a: engines.append(one_engine(*a)) or engines[-1])
    kw = dict(max_tokens=12, top_logprobs=3, grammar=("regex", WORDS))
    # a prompt neither agent has seen: the batched agent's prompt cache would prefill only its
    # tail (other shapes, other floats)
    prompt = f"seven eight nine ten ({forward})"
    want = _streamed(batched, prompt, **kw)
    got = _streamed(solo, prompt, **kw)
    assert [e.invariant for e in engines] == [forward == "own"]
    assert got[1] == want[1] and got[0].text == want[0].text
    assert len(got[2]) == len(got[1]) > 0 and len(got[3]) == len(got[1])
    assert all(len(t) == 3 for t in got[3])
    assert [[tok for tok, _ in t] for t in got[3]] == [[tok for tok, _ in t] for t in want[3]]
    if forward == "flat":
        assert got[2:] == want[2:]
    else:
        assert got[2] == pytest.approx(want[2], rel=LOGPROB_RTOL, abs=LOGPROB_ATOL)
        assert [lp for t in got[3] for _, lp in t] == pytest.approx(
            [lp for t in want[3] for _, lp in t], rel=LOGPROB_RTOL, abs=LOGPROB_ATOL)
    # the answer so far (max_tokens may cut it): a prefix of a match
    assert re.fullmatch(r"[a-z]{1,6}( [a-z]{1,6})* ?", got[0].text), got[0].text


@pytest.mark.parametrize("which", ["batched", "solo"])
def test_a_bad_grammar_or_top_logprobs_is_refused_on_either_path(agents, which):
    """Lifting the one-session refusals keeps the checks: a grammar that does not compile and
    top_logprobs out of range are refused before any decoding, on either path."""
    from bridge.errors import ProtocolError

    prop, batched, solo = agents
    ver = batched if which == "batched" else solo
    with pytest.raises(ProtocolError, match="response_format"):
        _streamed(ver, PROMPTS[0], max_tokens=4, grammar=("regex", "(("))
    with pytest.raises(ProtocolError, match="top_logprobs must be"):
        _streamed(ver, PROMPTS[0], max_tokens=4, top_logprobs=21)
