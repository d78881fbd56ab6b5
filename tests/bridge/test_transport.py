"""Server / Client / Publisher / Subscriber over real loopback sockets (random ports, linger 0)."""

from __future__ import annotations

import random
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from bridge import auth, codec
from bridge.card import PROTOCOL_VERSION
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import (AgentEvent, BlockMetrics, DraftReply, DraftRequest, ErrorReply,
                             GenerateChunk, GenerateDone, GenerateRequest, Ping, Pong, equal,
                             example)
from bridge.transport import Client, Limits, Publisher, Server, Subscriber
from macfleet.stats import GenerationStats

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
T = 3.0  # generous per-wait deadline; tests finish far sooner


class Agent:
    """A small handler: ping -> pong, draft -> probs, generate -> streamed chunks from workers."""

    def __init__(self) -> None:
        self.workers: list[threading.Thread] = []
        self.seen: list[codec.Envelope] = []

    def __call__(self, env, reply):
        self.seen.append(env)
        msg = env.msg
        if isinstance(msg, Ping):
            if msg.seq < 0:
                return  # never answered: lets tests time out
            if msg.seq == 13:
                raise RuntimeError("unlucky")
            reply(Pong(msg.seq, msg.sent_ns, "agent"))
        elif isinstance(msg, DraftRequest):
            if msg.k > 64:
                raise ProtocolError("bad_request", "k too large")
            probs = np.full((msg.k, 7), 1 / 7, np.float32) if msg.want_probs else None
            reply(DraftReply(msg.session_id, msg.block, list(range(msg.k)), probs, 0.5, False))
        elif isinstance(msg, GenerateRequest):
            worker = threading.Thread(target=self._generate, args=(msg, reply))
            self.workers.append(worker)
            worker.start()

    def _generate(self, msg, reply):
        time.sleep(0.01)  # the handler has returned: these replies come from another thread
        for i in range(msg.max_tokens):
            reply(GenerateChunk(msg.request_id, [i], f"t{i}"))
        reply(GenerateDone(msg.request_id, "done", list(range(msg.max_tokens)),
                           GenerationStats(tokens=msg.max_tokens)))


@pytest.fixture
def agent():
    return Agent()


@pytest.fixture
def server(agent):
    with Server(agent, key=KEY, poll_s=0.02, limits=Limits(max_frame_bytes=4096, max_frames=8)) as srv:
        yield srv
    for w in agent.workers:
        w.join(T)


@pytest.fixture
def client(server):
    with Client(server.endpoint, key=KEY, connect_timeout_s=T) as c:
        yield c


@pytest.fixture
def raw(server):
    """A bare DEALER for sending hand-made frames."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.apply_curve(sock, KEY, server=False)
    sock.connect(server.endpoint)
    yield sock
    sock.close(linger=0)


def raw_reply(sock):
    assert sock.poll(int(T * 1000)), "no reply"
    return codec.decode(sock.recv_multipart())


def generate(n, rid="r1"):
    return GenerateRequest(rid, "hi", False, n, 0.0, 1.0, None, -1, [], "ngram", False)


# --- request / reply ---------------------------------------------------------------------------


def test_request_reply(client, agent):
    assert client.request(Ping(7, 123), T) == Pong(7, 123, "agent")
    assert client.request(Ping(8, 1), T, session="s9") == Pong(8, 1, "agent")
    assert agent.seen[-1].header.session == "s9"


def test_arrays_over_the_wire_and_byte_counts(client):
    reply = client.request(DraftRequest("s", 4, [1, 2], 5, True), T)
    assert reply.probs.shape == (5, 7) and reply.probs.dtype == np.float32
    assert client.last_recv_bytes > 5 * 7 * 4 and client.last_sent_bytes > 0
    assert client.bytes_received >= client.last_recv_bytes
    assert client.request(DraftRequest("s", 5, [], 3, False), T).probs is None


def test_handler_errors_become_error_replies(client):
    with pytest.raises(ProtocolError) as info:
        client.request(DraftRequest("s", 0, [], 100, False), T)
    assert info.value.code == "bad_request"
    with pytest.raises(ProtocolError) as info:
        client.request(Ping(13, 0), T)
    assert info.value.code == "internal" and "unlucky" in info.value.message
    assert client.request(Ping(1, 0), T).seq == 1  # still serving


def test_streaming_from_worker_threads(client):
    replies = list(client.stream(generate(5), T))
    assert [type(r) for r in replies] == [GenerateChunk] * 5 + [GenerateDone]
    assert [r.token_ids for r in replies[:-1]] == [[i] for i in range(5)]
    assert replies[-1].stats == GenerationStats(tokens=5)


def test_concurrent_replies_from_many_threads(server):
    def handler(env, reply):
        threads = [threading.Thread(target=reply, args=(GenerateChunk("r", [i], ""),)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(T)
        reply(GenerateDone("r", "", [], GenerationStats()))

    with Server(handler, key=KEY, poll_s=0.02) as srv, Client(srv.endpoint, key=KEY) as c:
        replies = list(c.stream(generate(0), T))
    assert sorted(r.token_ids[0] for r in replies[:-1]) == list(range(16))
    assert isinstance(replies[-1], GenerateDone)


def test_timeout_rebuilds_socket_and_next_request_works(client):
    with pytest.raises(TransportTimeout):
        client.request(Ping(-1, 0), 0.2)
    assert client.rebuilds == 1
    assert client.request(Ping(2, 0), T).seq == 2


def test_stale_replies_are_discarded(client):
    first = client.send(Ping(100, 0))
    assert client.request(Ping(101, 0), T).seq == 101  # the reply to 100 came first, discarded
    with pytest.raises(TransportTimeout):
        client.recv(0.1)  # nothing left over
    assert first


def test_pipelined_send_recv(client):
    ids = [client.send(Ping(i, 0)) for i in range(5)]
    envs = [client.recv(T) for _ in ids]
    assert [e.header.reply_to for e in envs] == ids
    assert [e.msg.seq for e in envs] == list(range(5))


def _refused(endpoint: str, deadline_s: float = 10.0) -> bool:
    """True once a plain TCP connect to `endpoint` is refused (within deadline_s): ZeroMQ
    closes a socket's listener in its I/O thread, after close() returns."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_peer_unavailable_when_nothing_listens():
    with Server(lambda env, reply: None, key=KEY) as srv:
        endpoint = srv.endpoint
    # once nothing listens (a loaded run connected while the closed server still accepted,
    # and waited out the request's deadline: TransportTimeout)
    assert _refused(endpoint)
    with Client(endpoint, key=KEY, connect_timeout_s=0.2) as c:
        with pytest.raises(PeerUnavailable):
            c.request(Ping(1, 0), 1.0)


def test_close_is_prompt_and_idempotent(agent):
    srv = Server(agent, key=KEY, poll_s=0.5).start()
    c = Client(srv.endpoint, key=KEY)
    t0 = time.monotonic()
    srv.close()
    assert time.monotonic() - t0 < 0.4  # woken, not waiting out the poll
    srv.close()
    c.close()
    c.close()
    Server(agent, key=KEY).close()  # never started


def test_reply_after_close_is_dropped(agent):
    saved = []
    with Server(lambda env, reply: saved.append(reply), key=KEY, poll_s=0.02) as srv:
        with Client(srv.endpoint, key=KEY) as c:
            c.send(Ping(1, 0))
            deadline = time.monotonic() + T
            while not saved and time.monotonic() < deadline:
                time.sleep(0.005)
    assert saved
    saved[0](Pong(1, 0, "late"))  # no exception, nothing sent


# --- auth over the wire ------------------------------------------------------------------------


def test_wrong_key_and_no_key_get_no_connection(server):
    """CURVE: a client without the fleet key never completes the handshake, so it cannot even
    send; the server's handler (and its error path) is never reached."""
    for key in (OTHER, None):
        with Client(server.endpoint, key=key, connect_timeout_s=0.25) as c:
            with pytest.raises(PeerUnavailable, match="fleet key"):
                c.request(Ping(1, 0), T)
    assert server.requests == 0 and server.errors == 0


def test_the_same_frames_twice_are_served_twice_inside_curve(raw):
    """No per-message replay window: inside a CURVE connection only a key holder can send, and
    it could as well send a fresh copy; outsiders cannot replay into CURVE at all."""
    frames = codec.encode(Ping(5, 0))
    for _ in range(2):
        raw.send_multipart(frames)
        assert raw_reply(raw).msg == Pong(5, 0, "agent")


def test_open_fleet_serves_without_key(agent):
    with Server(agent, key=None) as srv, Client(srv.endpoint, key=None) as c:
        assert c.request(Ping(3, 0), T).seq == 3


# --- a live server under malformed traffic -----------------------------------------------------


def malformed_messages(rng: random.Random) -> list[tuple[list[bytes], str | None]]:
    """(frames, expected error code or None for 'any code')."""
    def hdr(**over):
        h = {"v": PROTOCOL_VERSION, "type": "ping", "id": f"id{rng.random()}", "session": "",
             "reply_to": None, "t_ns": time.time_ns()}
        h.update(over)
        return msgpack.packb(h)

    good_body = msgpack.packb({"seq": 1, "sent_ns": 2})
    out: list[tuple[list[bytes], str | None]] = []
    for _ in range(60):
        n = rng.randint(1, 5)
        out.append(([rng.randbytes(rng.randint(0, 40)) for _ in range(n)], None))  # garbage
        out.append(([hdr(type=f"t{rng.random()}"), good_body], "unknown_type"))
        out.append(([hdr(v=rng.randint(PROTOCOL_VERSION + 1, 99)), good_body], "bad_version"))
        out.append(([hdr(), msgpack.packb({"seq": "x", "sent_ns": 2})], "malformed"))
    desc = {"__frame__": 0, "dtype": "float32", "shape": [2000]}
    body = msgpack.packb({"session_id": "s", "block": 0, "positions": [], "states": desc})
    out.append(([hdr(type="hidden_states"), body, bytes(8000)], "oversize"))
    out.append(([hdr(), good_body, *[b""] * 20], "oversize"))  # too many frames
    return out


def test_live_server_survives_malformed_traffic(server, raw, client):
    cases = malformed_messages(random.Random(7))
    for frames, _ in cases:
        raw.send_multipart(frames)
    for frames, code in cases:
        env = raw_reply(raw)
        assert isinstance(env.msg, ErrorReply)
        if code is not None:
            assert env.msg.code == code, (frames, env.msg)
    assert server.errors == len(cases)
    assert client.request(Ping(42, 0), T).seq == 42


# --- pub / sub ---------------------------------------------------------------------------------


def receive_published(pub, sub, msg, **kw):
    """Publish until the subscriber has joined (PUB drops messages before that)."""
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        pub.publish(msg, **kw)
        try:
            return sub.recv(0.05)
        except TransportTimeout:
            continue
    raise AssertionError("subscriber never received")


def test_publish_subscribe():
    metrics = example(BlockMetrics)
    with Publisher(key=KEY) as pub, Subscriber([pub.endpoint], key=KEY) as sub:
        env = receive_published(pub, sub, metrics)
        assert equal(env.msg, metrics)
        event = AgentEvent("n", "joined", "hello", 1.5)
        assert pub.publish(event) > 0
        while not isinstance((env := sub.recv(T)).msg, AgentEvent):
            pass
        assert env.msg == event


def test_subscriber_topics_and_wrong_key():
    with Publisher(key=KEY) as pub, \
            Subscriber([pub.endpoint], key=KEY, topics=["agent_event"]) as sub, \
            Subscriber([pub.endpoint], key=OTHER) as wrong:
        event = AgentEvent("n", "k", "t", 0.0)
        receive_published(pub, sub, event)
        pub.publish(example(BlockMetrics))
        pub.publish(event)
        assert isinstance(sub.recv(T).msg, AgentEvent)  # metrics were filtered out
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # CURVE: the wrong key never joins, reads nothing
            pub.publish(event)
            with pytest.raises(TransportTimeout):
                wrong.recv(0.05)
        assert wrong.dropped == 0
    pub.close()
    assert pub.publish(event) == 0


@pytest.mark.parametrize("watch", [True, False])
def test_a_dead_peer_fails_a_watched_recv_at_once(watch):
    """The peer's socket goes away mid-request (its process died): with watch_peer the pending
    recv raises PeerUnavailable at once instead of waiting out its deadline."""
    srv = Server(lambda env, reply: None, key=KEY, poll_s=0.02).start()  # never answers
    with Client(srv.endpoint, key=KEY, watch_peer=watch) as c:
        c.send(Ping(1, 0))
        time.sleep(0.2)
        srv.close()
        t0 = time.monotonic()
        if watch:
            with pytest.raises(PeerUnavailable, match="lost"):
                c.recv(5.0)
            assert time.monotonic() - t0 < 1.0
        else:
            with pytest.raises(TransportTimeout):  # its deadline, not "lost" at once
                c.recv(0.3)
