"""`--proposer auto` through a fleet (issue 44): the verifier agent chooses, block by block,
among the drafters it has itself (engine/choosing.py), in its continuous batch and one session
alone, and says so in its stats and BlockMetrics (the dashboard's source).

Token ids: the "greedy margin" rule of tests/tolerance.py -- drafted blocks against the
verifier alone (`none`) on the same agent.
"""

from __future__ import annotations

import pytest

from agents.daemon import Agent, AgentConfig
from bridge.errors import BAD_REQUEST, ProtocolError
from bridge.messages import BlockMetrics
from macfleet.engine.chooser import PLAIN
from macfleet.engine.verifier import Verifier
from macfleet.fleet.metrics import SessionMetrics
from remote_gen import generate_done

KEY = b"k" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed
MODEL = "tiny:3"
PROMPTS = ["a b a b a b a b", "the cat sat on the mat, the cat sat on the mat"]


@pytest.fixture(scope="module")
def verifiers():
    batched = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                                allow_peers=LOCAL))
    solo = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL, batch_sessions=0))
    yield {"batched": batched, "solo": solo}
    batched.close()
    solo.close()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["batched", pytest.param(  # the fast lane: the default verifier
    "solo", marks=pytest.mark.slow)])
def test_the_verifier_agent_chooses_with_plain_decodings_answer(verifiers, which):
    ver = verifiers[which]
    assert (ver.verifier.batch_view() is not None) == (which == "batched")
    seen, publish = [], ver.verifier.generations.publish
    ver.verifier.generations.publish = lambda m: (seen.append(m), publish(m))
    try:
        for prompt in PROMPTS:
            plain = generate_done(ver.card, KEY, prompt, [], "none", max_tokens=32)
            auto = generate_done(ver.card, KEY, prompt, [], "auto", max_tokens=32)
            assert auto.token_ids == plain.token_ids
            st = auto.stats
            assert st.proposer == "auto" and st.blocks > 0
            assert len(st.choices) == st.blocks == sum(d.blocks for d in st.drafters)
            assert {d.name for d in st.drafters} == {PLAIN, "ngram"}  # its candidates here
            blocks = [m for m in seen if isinstance(m, BlockMetrics)
                      and m.session_id == auto.request_id]
            # each published block names its candidate and why, as the session's record does
            assert [(b.drafter, b.why) for b in blocks] == [(c.drafter, c.why)
                                                            for c in st.choices]
            assert all(b.drafter and b.why for b in blocks)
            sm = SessionMetrics(auto.request_id, "v")  # what `macfleet dash` shows of them
            for b in blocks:
                sm.apply(b, now=0.0)
            view = sm.view(now=0.0)
            assert (view.drafter, view.why) == (blocks[-1].drafter, blocks[-1].why)
            assert sum(d.blocks for d in view.drafters) == len(blocks)
            # a fixed drafter's blocks name none
            assert all(not m.drafter for m in seen if isinstance(m, BlockMetrics)
                       and m.session_id == plain.request_id)
    finally:
        ver.verifier.generations.publish = publish


def test_auto_with_proposer_endpoints_is_refused_by_name(verifiers):
    """The chooser runs on the verifier's own drafters: remote ones are not its candidates."""
    ver = verifiers["batched"]
    with pytest.raises(ProtocolError) as e:
        generate_done(ver.card, KEY, PROMPTS[0], ["tcp://127.0.0.1:9"], "auto", max_tokens=4)
    assert e.value.code == BAD_REQUEST and "'auto' is chosen on the verifier" in e.value.message


def test_auto_stays_unknown_to_the_drafter_spec_check():
    """A proposer agent (and a verifier agent older than the chooser on agents) refuses `auto`
    as a drafter by name, so an old verifier fails the request clearly; the CLI says why."""
    from agents.specs import SpecPolicy, check_spec
    from macfleet.cli.cmd_generate import older_agent_hint

    with pytest.raises(ProtocolError) as e:
        check_spec("auto", SpecPolicy())
    assert e.value.code == BAD_REQUEST and "unknown proposer 'auto'" in e.value.message
    assert "predates" in older_agent_hint("auto", f"verifier v: {e.value}")
    assert older_agent_hint("ngram", f"verifier v: {e.value}") == ""
    assert older_agent_hint("auto", "verifier v: busy") == ""


def test_drafting_for_sends_auto_to_the_verifier_alone():
    """Pure: `auto` names no proposer agent (the verifier chooses among its own drafters),
    but a fleet's draft-model agents still draft ahead for it; a named drafter is unchanged."""
    from types import SimpleNamespace as NS

    from bridge.card import AHEAD_KIND
    from macfleet.fleet.client import drafting_for

    prop = NS(card=NS(draft_model=""))
    ahead = NS(card=NS(draft_model="tiny:4"))
    assert drafting_for("auto", [prop], draft_agents=True) == ("auto", [])
    assert drafting_for("auto", [prop, ahead], draft_agents=True) == (AHEAD_KIND, [ahead])
    assert drafting_for("ngram", [prop, ahead], draft_agents=False) == ("ngram", [prop])


@pytest.mark.slow
@pytest.mark.parametrize("asked", ["auto", "ngram"])
def test_generate_through_a_fleet(verifiers, monkeypatch, capsys, asked):
    """`macfleet generate --proposer auto` with a fleet of a verifier and a proposer agent: the
    verifier agent chooses (no proposer agent named); `--proposer ngram` still drafts on the
    proposer agent. Both answer as the verifier alone does."""
    import argparse
    import json

    from macfleet.cli import cmd_generate
    from macfleet.fleet import client

    ver = verifiers["batched"]
    prop = Agent(AgentConfig(role="proposer", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL))
    try:
        monkeypatch.setattr(client, "members", lambda *a, **k: [ver.card, prop.card])
        monkeypatch.setattr("macfleet.fleet.keys.resolve_key", lambda *a, **k: KEY)
        args = argparse.Namespace(
            prompt=PROMPTS[0], model=MODEL, proposer=asked, draft_tokens="auto",
            max_tokens=32, temp=0.0, top_p=1.0, seed=None, no_chat=True, json=True,
            local=False, no_cross_round=False, key=None, open=False, wait=0.1,
            response_format=None)
        assert cmd_generate.run(args) == 0
        out = capsys.readouterr()
    finally:
        prop.close()
    doc = json.loads(out.out)
    plain = generate_done(ver.card, KEY, PROMPTS[0], [], "none", max_tokens=32)
    assert doc["token_ids"] == plain.token_ids
    st, where = doc["stats"], doc["stats"]["where"]
    assert where["mode"] == "fleet" and where["verifier"] == ver.name
    if asked == "auto":
        assert st["proposer"] == "auto" and st["choices"] and not where["proposers"]
        assert st["fleet"]["flows"]["remote_blocks"] == 0
    else:
        assert where["proposers"] == [prop.name] and not st["choices"]
        assert st["fleet"]["flows"]["remote_blocks"] > 0


class ForwardsElsewhere(Verifier):
    """A verifier whose forwards run elsewhere, as a `ShardedVerifier` (agents/shard.py) on a
    shard group's rank 0: the `Verifier` calls (not its __init__), no KV cache of its own to
    verify a tree in."""

    def __init__(self, model) -> None:
        self._v = Verifier(model)
        self.model = model

    offset = property(lambda self: self._v.offset)

    def reset(self) -> None:
        self._v.reset()

    def prefill(self, tokens) -> None:
        self._v.prefill(tokens)

    def forward(self, tokens):
        return self._v.forward(tokens)

    def rollback(self, n: int) -> None:
        self._v.rollback(n)


def test_a_verifier_without_tree_verification_here_drafts_chains_for_auto():
    """A sharded verifier verifies no token tree (its forwards cross the ranks): `auto` there
    is n-gram chains, with the verifier alone's answer, instead of an error."""
    from macfleet.engine.models import load_model

    ver = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                            allow_peers=LOCAL))
    try:
        ver.verifier.close()
        ver.verifier = ver._verifier_service(ForwardsElsewhere(load_model(MODEL).model))
        plain = generate_done(ver.card, KEY, PROMPTS[0], [], "none", max_tokens=32)
        auto = generate_done(ver.card, KEY, PROMPTS[0], [], "auto", max_tokens=32,
                             draft_tokens=3)
    finally:
        ver.close()
    assert auto.token_ids == plain.token_ids
    assert auto.stats.proposer.startswith("ngram") and not auto.stats.choices
    assert auto.stats.drafted > 0
