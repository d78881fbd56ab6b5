"""GET /v1/macfleet/batch on a real `macfleet serve` (tiny model), read by the dashboard's own
client (fleet/serve_watch.py): iterations with decode and prefill tokens, per-session TTFT and
inter-token latency, the API key, and a server that is down or silent shown as such, in time."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from serve_testkit import start_server, stop_server

from macfleet.fleet.serve_watch import ServeWatchSource, fetch_batch

pytestmark = pytest.mark.slow  # each test starts or uses a `macfleet serve` process

DEADLINE_S = 0.3


def _request(server, prompt: str, max_tokens: int) -> None:
    r = httpx.post(server.v1 + "/completions", headers=server.headers(), timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "stream": True})
    assert r.status_code == 200


def test_the_batch_needs_the_api_key(server):
    v = fetch_batch(server.base, timeout_s=5)
    assert v.batch is None and v.state == "down" and "401" in v.error
    v = fetch_batch(server.v1, api_key=server.key, timeout_s=5)  # the OpenAI base URL works too
    assert v.state == "up" and v.batch.model == "tiny:1" and v.batch.mode == "batched"


def _watch(src, server, prompts: list[str]) -> list:
    """The batch as the dashboard polls it while `prompts` are answered (150 tokens each)."""
    threads = [threading.Thread(target=_request, args=(server, p, 150)) for p in prompts]
    seen = []
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            snap = src.poll(timeout_s=1.0)
            assert snap is not None and snap.serve.state == "up"
            seen.append(snap.serve.batch)
            time.sleep(0.02)
    finally:
        for t in threads:
            t.join(60)
    return seen


def test_dashboard_client_sees_iterations_and_session_latencies(server):
    """The dashboard shows the last 32 iterations: a long prompt's prefill iterations come
    first, and on a loaded box the first poll can arrive 32 iterations later (failed once in a
    full run, "any(it.prefill_tokens ...)" False). A long prompt is asked again, beside nothing
    else, until a poll has shown a prefill iteration: the test observes it, it does not race."""
    src = ServeWatchSource(server.base, api_key=server.key)
    prompts = ["hello " * 80, "tell me a story " * 3, "one two three " * 4, "abc " * 10]
    try:
        seen = _watch(src, server, prompts)
        for _ in range(3):
            if any(it.prefill_tokens for b in seen for it in b.recent):
                break
            seen += _watch(src, server, ["hello " * 80])
        end = src.poll(timeout_s=1.0).serve.batch
    finally:
        src.close()
    recent = [it for b in [*seen, end] for it in b.recent]
    assert max(it.sessions for it in recent) >= 2  # sessions shared a forward
    assert any(it.decode_tokens for it in recent) and any(it.prefill_tokens for it in recent)
    assert all(it.decode_tokens + it.prefill_tokens > 0 and it.ms > 0 for it in recent)
    assert any(b.active >= 2 for b in seen)
    assert end.active == 0 and end.waiting == 0 and end.iterations >= len(end.recent) > 0
    done = {s.sid: s for s in end.sessions if s.state == "done"}
    assert len(done) >= len(prompts)
    for s in done.values():
        assert s.generated > 0 and s.prefill_left == 0 and s.ttft_ms > 0
        assert 0 < s.itl_p50_ms <= s.itl_p99_ms
    assert max(s.prompt_tokens for s in done.values()) >= 400  # chunked: over the 256-token budget


def test_a_server_that_is_down_or_silent_shows_as_such_within_the_deadline():
    s = start_server()
    try:
        assert fetch_batch(s.base, api_key=s.key, timeout_s=5).state == "up"
    finally:
        stop_server(s)
    t0 = time.monotonic()
    v = fetch_batch(s.base, api_key=s.key, timeout_s=DEADLINE_S)
    assert v.state == "down" and "refused" in v.error
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        v = fetch_batch(url, timeout_s=DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S + 0.5
        assert v.state == "down" and f"no answer within {DEADLINE_S:g} s" in v.error
        src = ServeWatchSource(url)
        t0 = time.monotonic()
        assert src.poll(timeout_s=DEADLINE_S).serve.state == "down"
        assert time.monotonic() - t0 < DEADLINE_S + 0.5
