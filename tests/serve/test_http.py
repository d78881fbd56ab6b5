"""Raw HTTP against a real `macfleet serve`: curl, error statuses, limits, disconnects."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import httpx
import pytest
from serve_testkit import wait_idle

from macfleet.serve.engine import Overloaded

CURL_TIMEOUT_S = 30


def _curl(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    return subprocess.run(["curl", "-sS", "-m", str(CURL_TIMEOUT_S), *args],
                          capture_output=True, text=True, timeout=CURL_TIMEOUT_S + 5)


@pytest.mark.slow  # the module's `macfleet serve` process
def test_curl_stream_ends_with_done(server):
    body = json.dumps({"model": "tiny:1", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 8, "temperature": 0, "stream": True})
    r = _curl("-N", server.v1 + "/chat/completions", "-H", "Content-Type: application/json",
              "-H", f"Authorization: Bearer {server.key}", "-d", body)
    events = [ln[6:] for ln in r.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(text) == 8 and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow  # the module's `macfleet serve` process
def test_curl_without_key_is_401_and_health_is_open(server):
    r = _curl("-w", "\n%{http_code}", server.v1 + "/models")
    body, code = r.stdout.rsplit("\n", 1)
    assert code == "401" and json.loads(body)["error"]["code"] == "invalid_api_key"
    r = _curl("-w", "\n%{http_code}", server.base + "/health")
    assert r.stdout.rsplit("\n", 1)[1] == "200"


@pytest.mark.slow  # the module's `macfleet serve` process
@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"[" * 5000 + b"]" * 5000, 400, None),  # deeper than the JSON parser's stack (was 500)
    (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
     400, "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), 400, "n"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "seed": -(2**70)}).encode(),
     400, "seed"),  # numpy refuses it: it once killed the engine thread (503 ever after)
    (json.dumps({"messages": [{"role": "user", "content": "x" * 700}]}).encode(), 400,
     "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 30000}]}).encode(), 413, None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "prediction": "abc"}).encode(),
     400, "prediction"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "prediction": {"type": "content", "content": [{"type": "image_url"}]}}).encode(),
     400, "prediction.content"),
])
def test_bad_requests_get_openai_errors_and_server_lives(server, body, status, param):
    r = httpx.post(server.v1 + "/chat/completions", content=body, timeout=10,
                   headers={**server.headers(), "Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert server.health()["status"] == "ok"


@pytest.mark.slow  # the module's `macfleet serve` process
def test_too_many_sessions_for_one_client_is_429(server):
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=30, headers=server.headers()) as c:
        streams = [c.stream("POST", server.v1 + "/chat/completions", json=body)
                   for _ in range(6)]
        opened = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            r = c.post(server.v1 + "/chat/completions", json=body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    assert wait_idle(server)["active_sessions"] == 0
    # the client's slots came back as the engine dropped its sessions
    with httpx.Client(timeout=30, headers=server.headers()) as c:
        r = c.post(server.v1 + "/chat/completions", json={**body, "stream": False,
                                                            "max_tokens": 2})
        assert r.status_code == 200


def _long_chat(server, stream: bool) -> socket.socket:
    """A 200-token chat completion asked over a raw socket, which the test closes mid-answer."""
    body = json.dumps({"messages": [{"role": "user", "content": "long one"}],
                       "max_tokens": 200, "temperature": 0, "stream": stream}).encode()
    host, port = server.base.removeprefix("http://").split(":")
    sk = socket.create_connection((host, int(port)), timeout=10)
    sk.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Content-Type: application/json\r\n"
               + f"Authorization: Bearer {server.key}\r\n".encode()
               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sk


@pytest.mark.slow  # the module's `macfleet serve` process
def test_client_that_disconnects_mid_stream_frees_its_session(server):
    with _long_chat(server, stream=True) as sk:
        got = b""
        deadline = time.monotonic() + 10
        while got.count(b"data: ") < 3 and time.monotonic() < deadline:
            got += sk.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
        h = server.health()
        assert h["active_sessions"] == 1 and h["sessions"][0]["generated"] >= 1
        assert h["sessions"][0]["ttft_ms"] > 0 and h["recent_iterations"]
    h = wait_idle(server)  # the socket closed mid-answer: the session goes at once
    assert h["active_sessions"] == 0
    r = httpx.post(server.v1 + "/completions", headers=server.headers(), timeout=10,
                   json={"prompt": "still alive", "max_tokens": 3})
    assert r.status_code == 200


@pytest.mark.slow  # the module's `macfleet serve` process
def test_client_that_leaves_before_a_whole_answer_frees_its_session(server):
    # no stream: nothing is written before the end, so no closed socket cancels the
    # response; the session asks whether its client is still there while it waits
    with _long_chat(server, stream=False):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            h = server.health()
            if h["active_sessions"] == 1 and h["sessions"][0]["generated"] >= 1:
                break
            time.sleep(0.05)
        assert h["active_sessions"] == 1 and h["sessions"][0]["generated"] < 200
        sid = h["sessions"][0]["sid"]
    h = wait_idle(server)  # the socket closed mid-answer: the session goes, cut short
    assert h["active_sessions"] == 0
    ended = next(s for s in h["sessions"] if s["sid"] == sid)
    assert ended["state"] == "cancelled" and ended["generated"] < 200, ended
    r = httpx.post(server.v1 + "/completions", headers=server.headers(), timeout=10,
                   json={"prompt": "still alive", "max_tokens": 3})
    assert r.status_code == 200


class _DeadEngine:
    """An engine whose verifier is gone (or whose queue is full): the app must say 503."""

    def __init__(self, alive: bool) -> None:
        self.alive, self.history, self.iterations = alive, [], 0

    def load(self):
        return 0, 0

    def recent(self, n=32):
        return []

    def sessions(self):
        return []

    def submit(self, req, emit, on_close=None):
        raise Overloaded("3 requests are already waiting")


@pytest.mark.parametrize("alive,code", [(False, "unavailable"), (True, "overloaded")])
def test_503_when_no_verifier_or_queue_full(alive, code):
    from starlette.testclient import TestClient

    from macfleet.engine.tiny import TinyTokenizer
    from macfleet.serve.app import ServerConfig, create_app

    app = create_app(_DeadEngine(alive), TinyTokenizer(64), ServerConfig("tiny:1"))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == code
        assert c.get("/health").status_code == (200 if alive else 503)
