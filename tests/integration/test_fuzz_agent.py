"""Fuzz a live agent over a real DEALER: >= 10,000 random and malformed multipart messages.

The agents run in this process (`agents.daemon.Agent`, tiny model, no Zeroconf) and are reached
over TCP on loopback exactly as a fleet member's client would reach them (CURVE with the fleet
key; peers without it get nothing at all, see tests/bridge/test_curve.py). Messages go out in
batches without waiting (the ROUTER sees them back to back), then replies are drained. Every
reply must decode to a registered type (a typed ErrorReply, or a normal
reply to a message that happened to be valid); the agent must keep serving real requests.
"""

from __future__ import annotations

import time
from collections import Counter

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge import codec
from bridge.auth import apply_curve
from bridge.card import PROTOCOL_VERSION
from bridge.errors import CODES
from bridge.messages import (DraftReply, DraftRequest, ErrorReply, GenerateDone, GenerateRequest,
                             OpenSession, Ping, Pong, SessionOpened, example, registry)
from bridge.transport import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow: >= 10,000 messages to live agents

KEY = b"k" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed
BATCH = 100
BATCHES = 50  # per agent: 5,000 messages each, 10,000 in all
DRAIN_QUIET_S = 0.25

TAGS = sorted(registry())
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=8)


def _valid(tag: str, seed: int, none: bool) -> list[bytes]:
    return [bytes(f) for f in codec.encode(example(registry()[tag], seed=seed, none=none))]


@st.composite
def mutated(draw) -> list[bytes]:
    """A valid encoding of some registered message with one or two mutations."""
    frames = _valid(draw(st.sampled_from(TAGS)), draw(st.integers(0, 5)), draw(st.booleans()))
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "drop", "dup", "body", "frame"]))
        i = draw(st.integers(0, len(frames) - 1))
        f = bytearray(frames[i])
        if op == "flip" and f:
            j = draw(st.integers(0, len(f) - 1))
            f[j] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            f = f[:draw(st.integers(0, len(f)))]
        elif op == "insert":
            j = draw(st.integers(0, len(f)))
            f[j:j] = draw(st.binary(min_size=1, max_size=8))
        elif op == "drop" and len(frames) > 1:
            frames.pop(i)
            continue
        elif op == "dup":
            frames.insert(i, bytes(f))
        elif op == "body" and len(frames) > 1:  # a well-formed map of the wrong fields/types
            frames[1] = msgpack.packb(draw(st.dictionaries(st.text(max_size=10),
                                                           msgpack_values, max_size=6)))
            continue
        elif op == "frame":
            frames.append(draw(st.binary(max_size=32)))
            continue
        frames[i] = bytes(f)
    return frames


@st.composite
def wrong_version(draw) -> list[bytes]:
    frames = _valid(draw(st.sampled_from(TAGS)), 0, False)
    h = msgpack.unpackb(frames[0])
    h["v"] = draw(st.integers(-(2**31), 2**31).filter(lambda v: v != PROTOCOL_VERSION)
                  | st.text(max_size=4) | st.none())
    return [msgpack.packb(h), *frames[1:]]


oversize = st.sampled_from([
    [b"\x81" + b"\xa1v" + b"\x01" + b"x" * 8000, b"\x80"],  # header above its 4 KiB cap
    [msgpack.packb({"v": PROTOCOL_VERSION, "type": "ping", "id": "x" * 200, "session": "",
                    "reply_to": None, "t_ns": 0}), b"\x80"],
    [b"h"] * (codec.DEFAULT_MAX_FRAMES + 5),  # too many frames
    [b"\x80"] * (codec.DEFAULT_MAX_FRAMES + 1),
])


one_message = st.one_of(
    st.lists(st.binary(max_size=48), min_size=1, max_size=6),
    mutated(),
    wrong_version(),
    oversize.map(list),
    # valid, of every registered type: reaches the agent's handler
    st.tuples(st.sampled_from(TAGS), st.integers(0, 5)).map(lambda t: _valid(t[0], t[1], False)),
)

FUZZ = settings(max_examples=BATCHES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def agents():
    from agents.daemon import Agent, AgentConfig

    made = {role: Agent(AgentConfig(role=role, model="tiny:1", key=KEY, advertise=False,
                                    allow_peers=LOCAL))
            for role in ("proposer", "verifier")}
    yield made
    for a in made.values():
        a.close()


class Dealer:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)
        apply_curve(self.sock, KEY, server=False)  # a fleet member: CURVE lets only those in
        self.sock.connect(endpoint)
        self.sent = 0
        self.replies: Counter[str] = Counter()

    def send_batch(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            self.sock.send_multipart(frames)
            self.sent += 1

    def drain(self, quiet_s: float = DRAIN_QUIET_S) -> None:
        """Read replies until none arrives for quiet_s; each must be a registered type."""
        while self.sock.poll(int(quiet_s * 1000), zmq.POLLIN):
            parts = self.sock.recv_multipart()
            env = codec.decode(parts)  # raises if the agent sent garbage
            msg = env.msg
            if isinstance(msg, ErrorReply):
                assert msg.code in CODES, msg
                self.replies[msg.code] += 1
            else:
                self.replies[type(msg).__name__] += 1

    def close(self) -> None:
        self.sock.close(linger=0)


def _fuzz(agent, fuzz_settings=FUZZ) -> Dealer:
    d = Dealer(agent.card.router_endpoint)

    @fuzz_settings
    @given(st.lists(one_message, min_size=BATCH, max_size=BATCH))
    def run(batch):
        d.send_batch(batch)
        d.drain(0.0)  # take what is already there; keep the pipes from filling

    try:
        run()
        d.drain()
    finally:
        d.close()
    return d


def _still_serves(agent) -> None:
    with Client(agent.card.router_endpoint, key=KEY) as c:
        assert isinstance(c.request(Ping(7, 0), timeout=10), Pong)


def test_fuzz_proposer_agent_then_it_drafts(agents):
    a = agents["proposer"]
    t0 = time.monotonic()
    d = _fuzz(a)
    assert d.sent >= BATCH * BATCHES
    assert sum(d.replies.values()) <= d.sent + 64  # never more than one reply per message
    assert d.replies["malformed"] > 0
    assert d.replies["bad_version"] > 0 and d.replies["oversize"] > 0
    assert d.replies["bad_request"] > 0 and d.replies["Pong"] > 0  # the handler was reached
    assert a.server._thread.is_alive() and a.proposer._thread.is_alive()
    _still_serves(a)
    with Client(a.card.router_endpoint, key=KEY) as c:
        r = c.request(OpenSession("after-fuzz", "ngram", "tiny:1", [1, 2, 3, 1, 2], 0.0, 1.0,
                                  None, False), timeout=10)
        assert isinstance(r, SessionOpened)
        r = c.request(DraftRequest("after-fuzz", 0, [], 4, False), timeout=10)
        assert isinstance(r, DraftReply) and len(r.tokens) <= 4
    print(f"proposer: {d.sent} messages in {time.monotonic() - t0:.1f}s, replies {dict(d.replies)}")


def test_fuzz_verifier_agent_then_it_generates(agents):
    a = agents["verifier"]
    t0 = time.monotonic()
    d = _fuzz(a)
    assert d.sent >= BATCH * BATCHES
    assert d.replies["malformed"] > 0
    assert a.server._thread.is_alive() and a.verifier._thread.is_alive()
    _still_serves(a)
    with Client(a.card.router_endpoint, key=KEY) as c:
        msgs = list(c.stream(GenerateRequest("after-fuzz", "the cat", False, 4, 0.0, 1.0, None,
                                             -1, [], "none", False), 30))
        assert isinstance(msgs[-1], GenerateDone) and len(msgs[-1].token_ids) == 4
    print(f"verifier: {d.sent} messages in {time.monotonic() - t0:.1f}s, replies {dict(d.replies)}")
