"""`serve` in front of a fleet outlives a verifier agent that once missed a deadline
(serve/remote.py `RemoteEngine.alive`): a transport error on a request makes the server answer
503, the verifier agent is asked for its status again (at most every RECHECK_S) and, once it
answers, requests are forwarded again; a verifier that stays silent stays a 503.

A real verifier agent in this process (the tiny model, ZeroMQ with CURVE on loopback); the
missed deadline is injected (`generate_remote` raising TransportTimeout once: what a loaded
machine's late chunk looks like to the client), the status request is real.
"""

from __future__ import annotations

import threading

import pytest

from agents.daemon import Agent, AgentConfig
from bridge.errors import TransportTimeout
from macfleet.engine.events import Finished
from macfleet.engine.sampling import GREEDY
from macfleet.fleet.client import AgentStatus
from macfleet.serve import remote
from macfleet.serve.engine import EngineRequest, SessionFailed

KEY = b"K" * 32
PROMPT = "the cat sat on the mat"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def verifier():
    agent = Agent(AgentConfig(role="verifier", model="tiny:1", key=KEY, advertise=False))
    try:
        yield agent
    finally:
        agent.close()


def ask(engine) -> object:
    done, got = threading.Event(), []

    def emit(ev) -> None:
        if isinstance(ev, (Finished, SessionFailed)):
            got.append(ev)
            done.set()
    engine.submit(EngineRequest((1,) * len(PROMPT), GREEDY, 8, text=PROMPT), emit)
    assert done.wait(60)
    return got[0]


def test_a_verifier_that_missed_a_deadline_is_asked_again_and_serves(verifier, monkeypatch):
    clock = Clock()
    engine = remote.RemoteEngine(AgentStatus(verifier.card, None, ()), [], KEY, clock=clock)
    assert isinstance(ask(engine), Finished) and engine.alive
    real = remote.generate_remote
    missed = []

    def late_once(*a, **kw):
        if not missed:
            missed.append(1)
            raise TransportTimeout("no chunk within the deadline")
        return real(*a, **kw)
    monkeypatch.setattr(remote, "generate_remote", late_once)
    assert isinstance(ask(engine), SessionFailed)
    assert engine.alive  # asked at once: the agent answers its status
    assert isinstance(ask(engine), Finished)


def test_a_silent_verifier_stays_unavailable_and_is_asked_at_most_every_recheck(
        verifier, monkeypatch):
    clock, asked = Clock(), []

    def silent(card, key, **kw):
        asked.append(card)
        return AgentStatus(card, None, (), "timed out")
    engine = remote.RemoteEngine(AgentStatus(verifier.card, None, ()), [], KEY, clock=clock,
                                 status=silent)

    def lost(*a, **kw):
        raise TransportTimeout("no chunk within the deadline")
    monkeypatch.setattr(remote, "generate_remote", lost)
    assert isinstance(ask(engine), SessionFailed)
    assert not engine.alive and len(asked) == 1
    assert not engine.alive and len(asked) == 1  # not asked again within RECHECK_S
    clock.t += remote.RECHECK_S
    assert not engine.alive and len(asked) == 2
    engine.stop()
    clock.t += remote.RECHECK_S
    assert not engine.alive and len(asked) == 2  # a stopped engine asks nobody
