"""The caps an agent enforces, each answered with a typed error while the agent keeps serving:
frame size (bridge Limits), draft length (ProposerLimits.max_k), sessions per agent
(ProposerLimits.max_sessions -> busy), prompt length (proposer and verifier), max_tokens."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from agents.proposer_service import ProposerLimits
from bridge.codec import Limits
from bridge.errors import BAD_REQUEST, BUSY, OVERSIZE, ProtocolError
from bridge.messages import (CloseSession, DraftReply, DraftRequest, GenerateRequest, HiddenStates,
                             OpenSession, Ping, Pong, SessionOpened)
from bridge.transport import Client, Server
from macfleet.engine.text import MAX_PROMPT_TOKENS

pytestmark = [pytest.mark.timeout(60)]

KEY = b"L" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed


@pytest.fixture(scope="module")
def agents():
    from agents.daemon import Agent, AgentConfig

    made = {role: Agent(AgentConfig(role=role, model="tiny:1", key=KEY, advertise=False,
                                    allow_peers=LOCAL))
            for role in ("proposer", "verifier")}
    made["proposer"].proposer.limits = ProposerLimits(max_sessions=2, max_k=8, max_prompt=64)
    yield made
    for a in made.values():
        a.close()


def code_of(client, msg) -> str:
    with pytest.raises(ProtocolError) as e:
        client.request(msg, timeout=10)
    return e.value.code


def open_session(sid, prompt=(1, 2, 3)):
    return OpenSession(sid, "ngram", "tiny:1", list(prompt), 0.0, 1.0, None, False)


def test_frame_size_cap_is_a_typed_oversize_and_the_server_keeps_serving():
    def echo(env, reply):
        reply(Pong(0, 0, "echo"))

    with Server(echo, key=KEY, limits=Limits(max_frame_bytes=4096)) as srv, \
            Client(srv.endpoint, key=KEY) as c:
        big = HiddenStates("s", 0, [0], np.zeros((1, 2048), np.float32))  # 8 KiB frame
        with pytest.raises(ProtocolError) as e:
            c.request(big, timeout=5)
        assert e.value.code == OVERSIZE
        ok = HiddenStates("s", 0, [0], np.zeros((1, 512), np.float32))  # 2 KiB: under the cap
        assert isinstance(c.request(ok, timeout=5), Pong)


def test_draft_length_cap(agents):
    with Client(agents["proposer"].card.router_endpoint, key=KEY) as c:
        assert isinstance(c.request(open_session("k"), timeout=10), SessionOpened)
        assert code_of(c, DraftRequest("k", 0, [], 9, False)) == BAD_REQUEST  # max_k = 8
        assert code_of(c, DraftRequest("k", 0, [], -1, False)) == BAD_REQUEST
        r = c.request(DraftRequest("k", 0, [], 8, False), timeout=10)
        assert isinstance(r, DraftReply) and len(r.tokens) <= 8
        c.request(CloseSession("k"), timeout=10)


def test_sessions_per_agent_cap_is_busy_and_frees_on_close(agents):
    with Client(agents["proposer"].card.router_endpoint, key=KEY) as c:
        for sid in ("s1", "s2"):
            assert isinstance(c.request(open_session(sid), timeout=10), SessionOpened)
        assert code_of(c, open_session("s3")) == BUSY
        c.request(CloseSession("s1"), timeout=10)
        assert isinstance(c.request(open_session("s3"), timeout=10), SessionOpened)
        for sid in ("s2", "s3"):
            c.request(CloseSession(sid), timeout=10)
        assert isinstance(c.request(Ping(1, 0), timeout=10), Pong)


def test_prompt_length_caps(agents):
    with Client(agents["proposer"].card.router_endpoint, key=KEY) as c:
        assert code_of(c, open_session("p", [1] * 65)) == BAD_REQUEST  # max_prompt = 64
        assert code_of(c, open_session("p", [])) == BAD_REQUEST
        assert isinstance(c.request(open_session("p", [1] * 64), timeout=10), SessionOpened)
        c.request(CloseSession("p"), timeout=10)
    gen = GenerateRequest("g", "a" * (MAX_PROMPT_TOKENS + 1), False, 4, 0.0, 1.0, None, -1, [],
                          "none", False)
    with Client(agents["verifier"].card.router_endpoint, key=KEY) as c:
        with pytest.raises(ProtocolError) as e:
            list(c.stream(gen, 30))
        assert e.value.code == BAD_REQUEST and str(MAX_PROMPT_TOKENS) in str(e.value)
        cap = agents["verifier"].verifier.limits.max_tokens
        with pytest.raises(ProtocolError) as e:
            list(c.stream(replace(gen, prompt="hi", max_tokens=cap + 1), 10))
        assert e.value.code == BAD_REQUEST
        done = list(c.stream(replace(gen, prompt="hi"), 30))[-1]
        assert len(done.token_ids) == 4
