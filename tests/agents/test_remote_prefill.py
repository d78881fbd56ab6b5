"""Flow KV in one process over real CURVE sockets: a prefill service and the verifier's fetch.

The prefill agent's side (agents/prefill_service.py) against the verifier's (agents/
remote_prefill.py `fetch_kv`): a complete KV equals a local prefill bit for bit; a partial,
silent, dead or mis-shaped one is a PrefillFailed within its deadline, never a hang.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from agents.prefill_service import PrefillLimits, PrefillService
from agents.remote_prefill import (DisaggPolicy, Meter, PrefillFailed, PrefillStage, fetch_kv,
                                   silence_s)
from bridge.errors import BAD_REQUEST, ProtocolError
from bridge.messages import GenerateRequest, KVChunk, PrefillDone, PrefillRequest
from bridge.transport import Client, Server
from macfleet.engine.kvship import model_layout
from macfleet.engine.models import load_model
from macfleet.engine.verifier import Verifier
from macfleet.stats import KVFlow

KEY = b"p" * 32
MODEL = "tiny:1"


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def prefill_server(lm):
    svc = PrefillService(lm, PrefillLimits(max_slice_bytes=8_000))
    server = Server(lambda env, reply: svc.handle(env.msg, reply) or None, key=KEY).start()
    yield server
    server.close()
    svc.close()


def ids_of(lm, n, seed=0):
    return np.random.default_rng(seed).integers(0, lm.vocab_size, n).tolist()


# the fast lane: the exact codec and float16 (int8's bound and scales: test_kvship.py in the
# lane, and over the wire in the default suite)
@pytest.mark.slow
@pytest.mark.parametrize("codec", ["auto", "float16", pytest.param("int8", marks=pytest.mark.slow)])
def test_fetched_kv_matches_a_local_prefill(lm, prefill_server, codec):
    ids = ids_of(lm, 1100)
    kv, flow = fetch_kv(prefill_server.endpoint, KEY, ids=ids, model=MODEL,
                        layout=model_layout(lm.model), codec=codec, silence=5, deadline_s=30)
    local = Verifier(lm.model)
    local.prefill(ids)
    assert flow.where == "remote" and flow.tokens == 1100 and flow.codec == codec
    assert flow.kv_bytes == 1100 * model_layout(lm.model).bytes_per_token(codec)
    for (k, v), c in zip(kv, local.cache):
        want = np.array(c.keys[0, :, :c.offset, :])
        if codec == "auto":
            assert np.array_equal(k, want)
        else:
            tol = np.abs(want).max(axis=-1, keepdims=True) / (127 if codec == "int8" else 1000)
            assert np.all(np.abs(k - want) <= tol + 1e-6)


def test_prefill_requests_are_checked(lm, prefill_server):
    with Client(prefill_server.endpoint, key=KEY) as c:
        for bad, words in [(PrefillRequest("s", "tiny:2", [1, 2], "auto"), "serves"),
                           (PrefillRequest("s", MODEL, [1, 2], "zip"), "codec"),
                           (PrefillRequest("s", MODEL, [], "auto"), "1.."),
                           (PrefillRequest("s", MODEL, [lm.vocab_size], "auto"), "vocabulary")]:
            with pytest.raises(ProtocolError) as e:
                c.request(bad, timeout=5)
            assert e.value.code == BAD_REQUEST and words in e.value.message


def fake_prefill(replies):
    """A server answering every PrefillRequest with `replies(msg)` (messages; None = stop)."""
    def handle(env, reply):
        for m in replies(env.msg):
            reply(m)
    return Server(handle, key=KEY).start()


def chunk(lm, start, n, layer=0, layers=None, dim=None):
    lay = model_layout(lm.model)
    k = np.zeros((layers or lay.layers, lay.heads, n, dim or lay.head_dim), np.float32)
    return KVChunk("s", layer, start, k, k)


@pytest.mark.parametrize("name,replies,words", [
    ("missing chunk", lambda lm: lambda m: [chunk(lm, 0, 4), PrefillDone("s", 8, 2, 0, 1.0)],
     "1 of 2"),
    ("wrong head size", lambda lm: lambda m: [chunk(lm, 0, 8, dim=3)], "heads x dim"),
    ("overlap", lambda lm: lambda m: [chunk(lm, 0, 8), chunk(lm, 4, 4)], "overlaps"),
])
def test_a_bad_kv_stream_is_refused(lm, name, replies, words):
    server = fake_prefill(replies(lm))
    try:
        with pytest.raises(PrefillFailed, match=words):
            fetch_kv(server.endpoint, KEY, ids=list(range(8)), model=MODEL,
                     layout=model_layout(lm.model), codec="auto", silence=2, deadline_s=5)
    finally:
        server.close()


def test_a_silent_prefill_agent_fails_at_its_silence_deadline(lm):
    server = fake_prefill(lambda m: [chunk(lm, 0, 4)])  # then nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(PrefillFailed, match="TransportTimeout"):
            fetch_kv(server.endpoint, KEY, ids=list(range(8)), model=MODEL,
                     layout=model_layout(lm.model), codec="auto", silence=0.5, deadline_s=5)
        assert time.monotonic() - t0 < 2.0
    finally:
        server.close()


def test_no_prefill_agent_at_the_endpoint_fails_fast(lm):
    t0 = time.monotonic()
    with pytest.raises(PrefillFailed, match="PeerUnavailable"):
        fetch_kv("tcp://127.0.0.1:9", KEY, ids=list(range(8)), model=MODEL,
                 layout=model_layout(lm.model), codec="auto", silence=3, deadline_s=5)
    assert time.monotonic() - t0 < 2.0


def test_meter_learns_speeds_and_link():
    m = Meter()
    m.local(1000, 2000.0)
    assert m.local_tok_s == 500.0
    m.remote(KVFlow(where="remote", tokens=1000, kv_bytes=10_000_000, kv_ms=1500.0,
                    prefill_ms=1000.0))
    assert m.remote_tok_s == 1000.0 and m.link_bytes_s == 2e7
    assert silence_s(512, 1000.0) == 3.0 and silence_s(512, 100.0) == pytest.approx(15.36)
    assert silence_s(512, 0.0) == 60.0  # nothing measured yet: a slow Mac is not a dead one
    # a speed measured on short prompts, for an 8,000-token one: its last chunks attend over
    # everything before them (measured ~6x the first chunk's time on one CPU core)
    assert silence_s(512, 100.0, 8000) >= 6 * silence_s(512, 100.0)


def test_stage_decides_and_falls_back(lm):
    """Through the stage: no agent -> local with the planner's reason; a dead agent -> a
    fallback with the same ids (the compute thread prefills locally)."""
    got = []
    eps: list[str] = []
    stage = PrefillStage(lm, key=KEY, layout=model_layout(lm.model), endpoints=lambda: eps,
                         submit=lambda msg, reply, staged: got.append(staged),
                         policy=DisaggPolicy(min_prompt_tokens=64))
    req = GenerateRequest("r", "x" * 600, False, 4, 0.0, 1.0, None, 0, [], "none", False)
    assert not stage.wants(req)  # no prefill agent
    eps.append("tcp://127.0.0.1:9")
    assert stage.wants(req)
    stage.put(req, None)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    stage.close()
    assert got and got[0].kv is None and got[0].flow.where == "fallback"
    assert got[0].ids == lm.tokenizer.encode("x" * 600)


@pytest.mark.slow
@pytest.mark.parametrize("batch_sessions", [0, 4])
@pytest.mark.parametrize("agent_alive", [False, True])
def test_flow_kv_in_the_answer_and_the_first_blocks_metrics(lm, prefill_server, batch_sessions,
                                                            agent_alive):
    """Through a verifier (its prompt alone or in its batch): a KV shipped by the prefill
    agent is in the answer's flow KV and on the first block's metrics only; when the agent is
    dead the verifier prefills the prompt itself after all, says so (`fallback`, no KV on any
    block) and the stage's meter learns this verifier's own prefill speed from it."""
    from agents.verifier_service import VerifierLimits, VerifierService
    from bridge.messages import BlockMetrics, ErrorReply, GenerateDone

    metrics, got = [], []
    ep = prefill_server.endpoint if agent_alive else "tcp://127.0.0.1:9"
    ver = VerifierService(lm, node_id="v", key=KEY, publish=metrics.append,
                          limits=VerifierLimits(batch_sessions=batch_sessions),
                          prefill_endpoints=lambda: [ep],
                          disagg=DisaggPolicy(min_prompt_tokens=64))
    meter = ver.generations.stage.meter
    meter.local(100, 10_000.0)  # as measured: this verifier slow, the agent and link fast
    meter.remote(KVFlow(where="remote", tokens=1000, kv_bytes=1000, kv_ms=1.0, prefill_ms=1.0))
    local_before = meter.local_tok_s
    try:
        req = GenerateRequest("r", "x" * 600, False, 3, 0.0, 1.0, None, 0, [], "none", False)
        ver.handle(req, got.append)
        deadline = time.monotonic() + 30
        while not any(isinstance(m, (GenerateDone, ErrorReply)) for m in got) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        ver.close()
    done = next(m for m in got if isinstance(m, GenerateDone))
    kv_per_block = [m.kv_bytes for m in metrics if isinstance(m, BlockMetrics)]
    kv = done.stats.fleet.kv
    if agent_alive:
        assert kv.where == "remote" and kv.kv_bytes > 0 and kv.install_ms > 0
        assert kv_per_block[0] == kv.kv_bytes and not any(kv_per_block[1:])
    else:
        assert kv.where == "fallback" and kv_per_block and not any(kv_per_block)
        assert meter.local_tok_s > local_before
