"""Drafting ahead: a draft-model agent pushing its stream, the verifier's mirror of it.

The rule both ends keep (draft_stream.survives, the agent's `_Session.apply`, the verifier's
`AheadMirror`) is checked here against a simulation with messages delayed at random: whatever
the timing, a draft the verifier takes was drafted from exactly the context it continues, and
with a drafter that is always right the verifier is never starved for good. Then real agents
over real sockets (tiny models): greedy output identical to the verifier alone through both
verifier paths, a draft agent that dies mid-answer, bad messages.
"""

from __future__ import annotations

import random
import threading
from collections import deque

import pytest

from agents.daemon import Agent, AgentConfig
from agents.draft_service import DraftAheadService, _Session
from agents.draft_stream import DraftStream, survives
from agents.remote_stream import AheadMirror
from bridge.errors import BAD_REQUEST, NOT_FOUND, ProtocolError
from bridge.messages import (DraftChunk, ErrorReply, GenerateChunk, GenerateDone, SessionOpened,
                             StreamCommit, StreamOpen)
from bridge.transport import Client
from macfleet.engine.controller import tokens_to_wait
from macfleet.engine.proposers.base import Draft, Proposer
from macfleet.engine.proposers.factory import ProposerSpecError, make_proposer
from macfleet.engine.models import load_model
from macfleet.fleet.client import generate_remote
from remote_gen import generate_done

KEY = b"d" * 32
LOCAL = ("tcp://127.0.0.1:*",)
V = 50


def f(ctx) -> int:
    """The simulated draft model: its next token after `ctx`."""
    return (sum(ctx[-3:]) * 7 + len(ctx)) % V


class FnProposer(Proposer):
    name = "fn"

    def propose(self, context, k):
        ctx, out = list(context), []
        for _ in range(k):
            out.append(f(ctx))
            ctx.append(out[-1])
        return Draft(tuple(out))


def test_a_stream_survives_a_commit_it_agrees_with_as_far_as_it_goes():
    assert survives([1, 2, 3], [1, 2])
    assert survives([1], [1, 2, 3])  # shorter: checked as far as it goes
    assert survives([], [4])
    assert not survives([1, 2], [1, 3])
    assert not survives([5], [4, 5])


def simulate(seed: int, wrong_every: int, blocks: int = 60, k: int = 5, lead: int = 8,
             agent_steps: tuple[int, int] = (0, 6)):
    """One session, messages delayed at random. The verifier's truth is f, except at contexts
    whose hash picks them (then f + 1): drafts there are refuted. agent_steps: how many steps
    (a token drafted or a commit read) the agent takes per block, at random in this range."""
    rng = random.Random(seed)

    def truth(ctx) -> int:
        t = f(ctx)
        return (t + 1) % V if wrong_every and hash(tuple(ctx[-4:])) % wrong_every == 0 else t

    prompt = [rng.randrange(V) for _ in range(5)]
    agent = _Session(DraftStream(FnProposer(), list(prompt), want_probs=False,
                                 cross_round=True), reply=None, max_lead=lead)
    mirror = AheadMirror(prompt)
    to_agent: deque = deque()
    to_verifier: deque = deque()
    ctx = list(prompt)
    taken = 0
    for _ in range(blocks):
        for _ in range(rng.randrange(*agent_steps)):  # the agent drafts and reads, in any order
            if to_agent and rng.random() < 0.5:
                agent.apply(to_agent.popleft())
            elif agent.wants_token:
                to_verifier.append(agent.draft("s"))
        for _ in range(rng.randrange(0, len(to_verifier) + 1)):
            mirror.add(to_verifier.popleft())
        drafts, _ = mirror.drafts(k)
        check = list(ctx)
        for d in drafts:  # every draft was drafted from exactly the context it continues
            assert d == f(check), (seed, ctx, drafts)
            check.append(d)
        taken += len(drafts)
        new = []
        for d in drafts:  # verify: the longest agreeing prefix, then the verifier's token
            if d != truth(ctx + new):
                break
            new.append(d)
        new.append(truth(ctx + new))
        seq = mirror.commit(new)
        to_agent.append(StreamCommit("s", seq, len(ctx), new))
        ctx += new
    return taken


@pytest.mark.slow
@pytest.mark.parametrize("wrong_every", [0, 3, 7])
def test_drafts_taken_from_a_delayed_stream_continue_exactly_their_context(wrong_every):
    taken = [simulate(seed, wrong_every) for seed in range(150)]
    assert sum(taken) > 0


@pytest.mark.parametrize("wrong_every", [0, 7])
def test_a_drafter_faster_than_the_verifier_keeps_it_fed(wrong_every):
    """An agent that drafts faster than the verifier commits keeps drafts coming after every
    refutation: the mirror is never stuck waiting for a stream the agent will not send (a
    refuted commit that did not mark the old stream dead starved it for good)."""
    taken = [simulate(seed, wrong_every, blocks=80, agent_steps=(8, 16)) for seed in range(40)]
    assert min(taken) > 80, taken


def test_a_mirror_drops_chunks_of_a_refuted_stream_and_takes_the_rerooted_one():
    m = AheadMirror([1, 2, 3])
    m.add(DraftChunk("s", 0, 3, [10, 11, 12], None, 1.0))
    assert m.drafts(5)[0] == [10, 11, 12]
    seq = m.commit([10, 99])  # 11 refuted: the agent will re-root at this commit
    assert m.have == 0
    m.add(DraftChunk("s", 0, 6, [13], None, 1.0))  # in flight before it saw the commit
    assert m.have == 0
    m.add(DraftChunk("s", seq, 5, [20, 21], None, 1.0))
    assert m.drafts(5)[0] == [20, 21] and m.basis == seq
    assert m.wasted == 3 and m.received == 6


def test_a_chunk_refuted_by_a_commit_the_agent_had_not_seen_waits_for_its_reroot():
    m = AheadMirror([1])
    s1 = m.commit([5])  # the mirror showed nothing: nothing to refute yet
    m.add(DraftChunk("s", 0, 1, [6, 7], None, 1.0))  # drafted before commit 1 reached it
    assert m.have == 0 and m.min_basis == s1
    m.add(DraftChunk("s", s1, 2, [8], None, 1.0))
    assert m.drafts(3)[0] == [8]


def test_tokens_to_wait():
    flat = lambda L: 100.0 + 5.0 * (L - 1)  # noqa: E731 - a verify cost curve
    # nothing there, drafts cheap and likely right: wait for some
    assert tokens_to_wait(0, 8, 0.9, 10.0, 10.0, flat) > 0
    # enough there: verify now; never more than k
    assert tokens_to_wait(8, 8, 0.9, 10.0, 10.0, flat) == 0
    assert tokens_to_wait(0, 3, 0.99, 1.0, 1.0, flat) <= 3
    # drafts that are rarely right and slow to come: verify what there is
    assert tokens_to_wait(0, 8, 0.05, 80.0, 80.0, flat) == 0


def test_draft_alone_is_a_fleet_spec():
    lm = load_model("tiny:3")
    with pytest.raises(ProposerSpecError, match="draft-model agent"):
        make_proposer("draft", lm)


# --- real agents over real sockets -------------------------------------------------------------


def agents(draft: str, **ver):
    prop = Agent(AgentConfig(role="proposer", model="tiny:3", draft=draft, key=KEY,
                             advertise=False, allow_peers=LOCAL))
    vers = Agent(AgentConfig(role="verifier", model="tiny:3", key=KEY, advertise=False,
                             allow_peers=LOCAL, **ver))
    return prop, vers


@pytest.fixture(scope="module", params=[None, 0], ids=["batched", "one-session"])
def fleet(request):
    prop, ver = agents("tiny:4", batch_sessions=request.param)
    yield ver, prop
    ver.close()
    prop.close()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["the cat sat on the mat", pytest.param(  # the fast lane: one
    "one two three four", marks=pytest.mark.slow)])
def test_drafted_ahead_greedy_equals_the_verifier_alone(fleet, prompt):
    ver, prop = fleet
    alone = generate_done(ver.card, KEY, prompt, [], "none", max_tokens=48)
    for k in (3, "auto"):
        d = generate_done(ver.card, KEY, prompt, [prop.card.router_endpoint], "draft",
                          max_tokens=48, draft_tokens=k)
        assert d.token_ids == alone.token_ids
        assert d.stats.proposer == "draft"
        assert d.stats.fleet.flows.remote_blocks > 0 and d.stats.fleet.proposer_failures == 0


@pytest.mark.slow
def test_a_self_drafting_agent_runs_ahead_and_its_drafts_are_taken(monkeypatch):
    """A verifier slower than its drafter (each iteration of its engine held 20 ms, as a big
    model's forward would be: the tiny models alone cost the same, and a loaded box decides
    who is ahead) finds its drafts waiting when its blocks begin. (The hold was on
    `Verifier.forward`, which the serving engine, the one decode path, no longer calls: the
    test passed only when the drafter was ahead anyway, and failed with 15-16 drafts in 64
    tokens on a busy box.)"""
    import time as _time

    from macfleet.serve.engine import BatchEngine

    real = BatchEngine._iteration

    def slow(self, *a, **kw):
        _time.sleep(0.02)
        return real(self, *a, **kw)

    monkeypatch.setattr(BatchEngine, "_iteration", slow)
    pushed = []  # the tokens of every chunk the draft agent pushed
    real_push = DraftAheadService._push
    monkeypatch.setattr(DraftAheadService, "_push", lambda self, s, chunk: (
        pushed.append(len(chunk.tokens) if chunk is not None else 0), real_push(self, s, chunk)))
    prop, ver = agents("tiny:3", batch_sessions=0)
    try:
        alone = generate_done(ver.card, KEY, "a b c d", [], "none", max_tokens=64)
        d = generate_done(ver.card, KEY, "a b c d", [prop.card.router_endpoint], "draft",
                          max_tokens=64, draft_tokens=4)
        assert d.token_ids == alone.token_ids
        assert d.stats.drafted > 16 and d.stats.accepted > 0.5 * d.stats.drafted
        assert sum(pushed) >= d.stats.drafted
        assert d.stats.fleet.flows.ahead_lead > 0  # drafts were there before blocks began
        assert d.stats.fleet.flows.ahead_token_ms > 0  # the agent's compute a token, reported
    finally:
        ver.close()
        prop.close()


@pytest.mark.slow
def test_a_draft_agent_dying_mid_answer_costs_drafts_never_tokens():
    prop, ver = agents("tiny:3")
    try:
        alone = generate_done(ver.card, KEY, "the dog ran", [], "none", max_tokens=200)
        ids, done = [], None
        for m in generate_remote(ver.card, KEY, prompt="the dog ran", chat=False,
                                 max_tokens=200, proposers=[prop.card.router_endpoint],
                                 proposer_spec="draft", draft_tokens=4):
            if isinstance(m, GenerateChunk):
                ids += m.token_ids
                if prop is not None and len(ids) > 8:
                    threading.Thread(target=prop.close).start()
                    prop = None
            elif isinstance(m, GenerateDone):
                done = m
        assert ids == list(alone.token_ids) == list(done.token_ids)
    finally:
        ver.close()
        if prop is not None:
            prop.close()


def test_the_draft_service_refuses_bad_messages_and_keeps_serving():
    lm = load_model("tiny:3")
    prop = Agent(AgentConfig(role="proposer", model="tiny:3", draft="tiny:3", key=KEY,
                             advertise=False, allow_peers=LOCAL))
    assert isinstance(prop.proposer, DraftAheadService)
    assert prop.card.models == ("tiny:3",) and prop.card.draft_model == "tiny:3"
    try:
        with Client(prop.card.router_endpoint, key=KEY) as c, \
                Client(prop.card.router_endpoint, key=KEY) as other:
            with pytest.raises(ProtocolError) as e:
                c.request(StreamOpen("s1", "another-model", [1, 2], 0.0, 1.0, None, 8))
            assert e.value.code == BAD_REQUEST
            with pytest.raises(ProtocolError):
                c.request(StreamOpen("s1", "tiny:3", [lm.vocab_size + 5], 0.0, 1.0, None, 8))
            with pytest.raises(ProtocolError):
                c.request(StreamOpen("s1", "tiny:3", [1, 2], 0.0, 1.0, None, 0))
            opened = c.request(StreamOpen("s1", "tiny:3", [1, 2, 3], 0.0, 1.0, None, 4))
            assert isinstance(opened, SessionOpened)
            chunk = c.recv(5.0).msg
            assert isinstance(chunk, DraftChunk) and chunk.start == 3
            with pytest.raises(ProtocolError) as e:  # another connection: not its session
                other.request(StreamCommit("s1", 1, 3, [4]))
            assert e.value.code == NOT_FOUND
            c.send(StreamCommit("s1", 5, 3, [4]))  # out of order: an error, nothing breaks
            while not isinstance(m := c.recv(5.0).msg, ErrorReply):
                pass
            assert "expected 1" in m.message
            again = c.request(StreamOpen("s2", "tiny:3", [1, 2, 3], 0.0, 1.0, None, 4))
            assert isinstance(again, SessionOpened)
    finally:
        prop.close()


def test_the_dashboard_shows_the_draft_agents_lead_and_waste():
    from bridge.messages import BlockMetrics
    from macfleet.fleet.metrics import SessionMetrics
    from tui.widgets.flows import compute_summary

    def block(i: int, lead: int, waste: float) -> BlockMetrics:
        return BlockMetrics(node_id="v", session_id="s", block=i, k=4, accepted=3,
                            block_ms=100.0, draft_ms=2.0, verify_ms=95.0, f1_bytes=60,
                            f1_ms=0.0, f2_bytes=200, f2_ms=0.0, f3_bytes=0, f3_ms=0.0,
                            probe=False, ahead_lead=lead, ahead_waste=waste)

    m = SessionMetrics("s", "v")
    m.apply(block(1, 2, 0.0), 0.0)
    m.apply(block(2, 4, 0.25), 0.1)
    v = m.view(0.2)
    assert v.ahead == (3.0, 0.25)
    assert "draft agent ahead by 3.0 drafts" in compute_summary(v)
    assert type(v).from_dict(v.to_dict()).ahead == v.ahead
    plain = SessionMetrics("t", "v")
    plain.apply(BlockMetrics(node_id="v", session_id="t", block=1, k=0, accepted=0,
                             block_ms=90.0, draft_ms=0.0, verify_ms=90.0, f1_bytes=0, f1_ms=0.0,
                             f2_bytes=0, f2_ms=0.0, f3_bytes=0, f3_ms=0.0, probe=False), 0.0)
    assert plain.view(0.1).ahead is None and "draft agent" not in compute_summary(plain.view(0.1))


def test_several_sessions_streams_are_drafted_in_one_forward_a_step(monkeypatch):
    """Serving many verifier sessions, the draft agent extends every stream in one forward of
    the draft model a step (their caches are rows of one store): each stream is still the
    draft model's own greedy continuation of its context, also after a commit refutes it."""
    import time as _time

    import agents.draft_service as ds
    from macfleet.engine.proposers.model_draft import ModelProposer
    from macfleet.engine.sampling import GREEDY

    together, real = [], ds.draft_together
    monkeypatch.setattr(ds, "draft_together",
                        lambda jobs, *a: together.append(len(jobs)) or real(jobs, *a))
    lm = load_model("tiny:3")
    svc = DraftAheadService(lm, serves="v")
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9, 10], "c": [11]}
    got: dict[str, dict[int, list[int]]] = {sid: {} for sid in prompts}  # sid -> basis -> ids

    def reply_for(sid):
        def reply(msg):
            if isinstance(msg, DraftChunk):
                toks = got[sid].setdefault(msg.basis, [])
                assert msg.start == (len(prompts[sid]) + (msg.basis > 0)) + len(toks)
                toks.extend(msg.tokens)
        return reply

    def greedy(ctx, n):
        p = ModelProposer(lm.model, "alone")
        p.start(GREEDY)
        return list(p.propose(ctx, n).tokens)

    def wait(cond):
        deadline = _time.monotonic() + 20
        while not cond():
            assert _time.monotonic() < deadline, got
            _time.sleep(0.01)

    try:
        for sid, p in prompts.items():
            svc.handle(StreamOpen(sid, "v", p, 0.0, 1.0, None, 6), reply_for(sid))
        wait(lambda: all(len(got[sid].get(0, ())) == 6 for sid in prompts))
        for sid, p in prompts.items():
            assert got[sid][0] == greedy(p, 6), sid
        assert together  # steps that drafted several streams in one forward
        # a commit that refutes a's stream: it re-roots there and drafts on, still together
        wrong = (got["a"][0][0] + 1) % lm.vocab_size
        svc.handle(StreamCommit("a", 1, len(prompts["a"]), [wrong]), lambda msg: None)
        wait(lambda: len(got["a"].get(1, ())) == 6)
        assert got["a"][1] == greedy(prompts["a"] + [wrong], 6)
    finally:
        svc.close()


def test_streams_that_fail_together_draft_alone_and_retry_rarely(monkeypatch):
    """A failure of the together forward ends no stream: each is drafted alone (still the draft
    model's own continuation), and the together forward is tried again only after
    APART_STEPS_MIN idle steps, doubling (it was retried, and logged, every step)."""
    import time as _time

    import agents.draft_service as ds
    from macfleet.engine.proposers.model_draft import ModelProposer
    from macfleet.engine.sampling import GREEDY

    calls = []

    def broken(jobs, clock=None):
        calls.append(len(jobs))
        raise RuntimeError("a flat forward this model cannot run")

    monkeypatch.setattr(ds, "draft_together", broken)
    lm = load_model("tiny:3")
    svc = DraftAheadService(lm, serves="v")
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [11]}
    got: dict[str, list[int]] = {sid: [] for sid in prompts}

    def reply_for(sid):
        return lambda msg: got[sid].extend(msg.tokens) if isinstance(msg, DraftChunk) else None

    try:
        for sid, p in prompts.items():
            svc.handle(StreamOpen(sid, "v", p, 0.0, 1.0, None, 8), reply_for(sid))
        deadline = _time.monotonic() + 20
        while not all(len(got[sid]) == 8 for sid in prompts):
            assert _time.monotonic() < deadline, got
            _time.sleep(0.01)
        assert svc._step >= 24  # 24 tokens alone, one a step
        # tried at the first step with several streams, then after 16 and 32 more at most
        assert 1 <= len(calls) <= 3, calls
        for sid, p in prompts.items():
            alone = ModelProposer(lm.model, "alone")
            alone.start(GREEDY)
            assert got[sid] == list(alone.propose(p, 8).tokens), sid
    finally:
        svc.close()


def test_a_closed_stream_closes_its_session_on_the_draft_agent():
    """StreamingProposer.close tells the agent (CloseSession, one-way, as its socket closes):
    the agent's session goes at once, not at its idle eviction."""
    import time

    from agents.remote_stream import StreamingProposer
    from bridge.transport import Server

    svc = DraftAheadService(load_model("tiny:3"), serves="tiny:3")
    server = Server(lambda env, reply: svc.handle(env.msg, reply), key=KEY,
                    bind="tcp://127.0.0.1:*").start()
    proposer = StreamingProposer(f"tcp://127.0.0.1:{server.port}", key=KEY, model="tiny:3")
    try:
        deadline = time.monotonic() + 10
        while svc.sessions == 0 and time.monotonic() < deadline:
            proposer.begin([1, 2, 3], 4)  # the first block opens the session
            proposer.finish()
        assert svc.sessions == 1
        proposer.close()
        deadline = time.monotonic() + 3
        while svc.sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        assert svc.sessions == 0
    finally:
        proposer.close()
        server.close()
        svc.close()
