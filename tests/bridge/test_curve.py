"""CURVE on the wire: keys derived from the fleet key, nothing for peers without it, and the
bytes on the wire are encrypted (a relay between client and server sees no plain text)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from bridge import auth, codec
from bridge.messages import AgentEvent, GenerateRequest, Ping, Pong
from bridge.transport import Client, Publisher, Server, Subscriber

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
SECRET_WORDS = b"purple-elephant-recipe"


def test_curve_keys_are_derived_deterministically():
    a, b = auth.curve_keys(KEY), auth.curve_keys(bytes(KEY))
    assert a == b != auth.curve_keys(OTHER)
    assert len(a.server_secret) == len(a.server_public) == 40  # z85 of 32 bytes
    assert a.server_public == zmq.curve_public(a.server_secret)
    assert a.client_public == zmq.curve_public(a.client_secret)
    assert len({a.server_public, a.server_secret, a.client_public, a.client_secret}) == 4
    assert KEY.hex().encode() not in a.server_public + a.client_public
    with pytest.raises(ValueError):
        auth.curve_keys(b"short")


def echo(env, reply):
    reply(Pong(getattr(env.msg, "seq", 0), 0, "echo"))


def silence_s(endpoint: str) -> float:
    """How long a peer without the key is watched for an answer: ten times a key holder's
    whole round trip (connect, CURVE handshake, ping) measured just now, at least 0.3 s. An
    answer the server wrongly gave would come as fast as the key holder's, and the window
    grows with the box's load instead of a fixed 1.5 s."""
    t = time.monotonic()
    with Client(endpoint, key=KEY) as c:
        assert c.request(Ping(8, 0), 5).seq == 8
    return max(0.3, 10 * (time.monotonic() - t))


def plain_dealer(endpoint: str, key: bytes | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.apply_curve(sock, key, server=False)
    sock.connect(endpoint)
    return sock


@pytest.mark.parametrize("key", [None, OTHER], ids=["no-key", "wrong-key"])
def test_peer_without_the_key_receives_nothing(key):
    """A raw DEALER (no CURVE, or CURVE with another fleet's key) sends a valid ping and gets
    nothing back within the deadline: no reply, no typed error, no echo."""
    with Server(echo, key=KEY, poll_s=0.02) as srv:
        window_ms = int(1000 * silence_s(srv.endpoint))
        served = srv.requests
        sock = plain_dealer(srv.endpoint, key)
        try:
            frames = [bytes(f) for f in codec.encode(Ping(1, 0))]
            if sock.poll(window_ms, zmq.POLLOUT):  # plain DEALER queues; CURVE one never connects
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:  # the server dropped the failed handshake between the two
                    pass
            assert not sock.poll(window_ms, zmq.POLLIN)
        finally:
            sock.close(linger=0)
        assert srv.requests == served
        with Client(srv.endpoint, key=KEY) as c:  # the key holder is still served
            assert c.request(Ping(9, 0), 5).seq == 9


def test_no_module_builds_zeromq_sockets_but_bridge_sockets():
    """Every fleet socket gets CURVE from bridge.sockets._socket; a socket made elsewhere could
    silently run in clear (there is no per-message MAC to catch it)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    pattern = re.compile(r"(?<!socket)\.socket\(|zmq\.Socket\(")  # not socket.socket(...)
    offenders = [str(p.relative_to(root)) for d in ("bridge", "agents", "macfleet", "tui")
                 for p in (root / d).rglob("*.py")
                 if pattern.search(p.read_text())]
    # the fuzz campaign's hostile probe builds raw sockets on purpose (no CURVE, wrong keys);
    # the ZAP handler's socket is inproc only
    assert sorted(offenders) == ["bridge/sockets.py", "bridge/zap.py", "macfleet/bench/fuzz.py"]


def rogue_client(endpoint: str, server_public: bytes) -> zmq.Socket:
    """A DEALER that knows the server's public key but holds a keypair of its own."""
    public, secret = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.connect(endpoint)
    return sock


def test_the_server_public_key_alone_admits_nobody():
    """ZAP admits only the fleet's client key: a peer that learnt the server public key but
    holds another client keypair completes no handshake and gets nothing."""
    from bridge import zap

    with Server(echo, key=KEY, poll_s=0.02) as srv:
        window_ms = int(1000 * silence_s(srv.endpoint))
        served = srv.requests
        before = zap.denied(zmq.Context.instance())
        sock = rogue_client(srv.endpoint, auth.curve_keys(KEY).server_public)
        try:
            if sock.poll(window_ms, zmq.POLLOUT):
                try:
                    sock.send_multipart([bytes(f) for f in codec.encode(Ping(1, 0))],
                                        flags=zmq.NOBLOCK)
                except zmq.Again:  # the server refused the handshake between the two
                    pass
            assert not sock.poll(window_ms, zmq.POLLIN)
        finally:
            sock.close(linger=0)
        assert srv.requests == served and zap.denied(zmq.Context.instance()) > before
        with Client(srv.endpoint, key=KEY) as c:  # the fleet's client key is admitted
            assert c.request(Ping(9, 0), 5).seq == 9


def test_zap_rule_is_the_fleet_client_key_in_its_domain():
    from bridge import zap
    from zmq.utils import z85

    client = z85.decode(auth.curve_keys(KEY).client_public)
    other = z85.decode(auth.curve_keys(OTHER).client_public)
    table = {auth.zap_domain(KEY): frozenset({client})}
    assert zap.decide(table, auth.zap_domain(KEY), b"CURVE", [client])[0] == b"200"
    for domain, mech, creds in [(auth.zap_domain(KEY), b"CURVE", [other]),
                                (auth.zap_domain(OTHER), b"CURVE", [client]),
                                (auth.zap_domain(KEY), b"NULL", []),
                                (auth.zap_domain(KEY), b"CURVE", [])]:
        assert zap.decide(table, domain, mech, creds)[0] == b"400"


def test_metrics_pub_only_reaches_key_holders():
    with Publisher(key=KEY) as pub, Subscriber([pub.endpoint], key=KEY) as sub:
        raw = zmq.Context.instance().socket(zmq.SUB)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(pub.endpoint)
        try:
            got = None
            deadline = time.monotonic() + 3
            while got is None and time.monotonic() < deadline:
                pub.publish(AgentEvent("n", "k", "t", 0.0))
                if sub._live().poll(50, zmq.POLLIN):
                    got = sub.recv(1)
            assert got is not None and isinstance(got.msg, AgentEvent)
            for _ in range(10):
                pub.publish(AgentEvent("n", "k", "t", 0.0))
            assert not raw.poll(500, zmq.POLLIN)
        finally:
            raw.close(linger=0)


class Relay:
    """A TCP relay that records every byte crossing it (a loopback 'capture')."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.captured = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.captured += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.lsock.close()


@pytest.mark.parametrize("key,visible", [(KEY, False), (None, True)], ids=["curve", "open"])
def test_prompt_is_not_readable_on_the_wire(key, visible):
    def handler(env, reply):
        reply(Pong(0, 0, env.msg.prompt))  # the answer carries the words back too

    with Server(handler, key=key, poll_s=0.02) as srv:
        relay = Relay(srv.port)
        try:
            with Client(f"tcp://127.0.0.1:{relay.port}", key=key) as c:
                req = GenerateRequest("r", SECRET_WORDS.decode(), False, 4, 0.0, 1.0, None, -1,
                                      [], "none", False)
                assert c.request(req, 5).node_id == SECRET_WORDS.decode()
        finally:
            relay.close()
        assert (SECRET_WORDS in relay.captured) is visible
