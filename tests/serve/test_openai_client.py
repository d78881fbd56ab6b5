"""The official `openai` client against a real `macfleet serve` (tiny model) on loopback."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
from serve_testkit import wait_idle

pytestmark = pytest.mark.slow  # a `macfleet serve` process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=server.key, timeout=30, max_retries=0)


def _chat(client, content: str, **kw):
    return client.chat.completions.create(
        model="tiny:1", messages=[{"role": "user", "content": content}], **kw)


def test_usage_reports_the_servers_own_draft_accounting():
    """usage.macfleet holds this request's drafts as the engine counted them (its session in
    GET /v1/macfleet/batch); the OpenAI fields, which count a prediction's tokens, are 0 without
    one. The drafter is the verifier's own model, so its greedy drafts are accepted (nearly)
    always: a count stuck at 0, or swapped with the other, fails."""
    from serve_testkit import start_server, stop_server

    from macfleet.fleet.serve_watch import fetch_batch

    server = start_server("--proposer", "draft:tiny:1", "--draft-tokens", "4")
    try:
        client = openai.OpenAI(base_url=server.v1, api_key=server.key, timeout=60,
                               max_retries=0)
        u = _chat(client, "the cat sat on the mat", max_tokens=40, temperature=0).usage
        batch = fetch_batch(server.v1, api_key=server.key, timeout_s=5).batch
    finally:
        stop_server(server)
    (mine,) = [s for s in batch.sessions if s.state == "done"]
    d, m = u.completion_tokens_details, u.model_extra["macfleet"]
    assert u.completion_tokens == mine.generated == 40
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (0, 0)
    assert (m["accepted_draft_tokens"], m["draft_tokens"]) == (mine.accepted, mine.drafted)
    assert 20 <= m["accepted_draft_tokens"] < 40  # a bonus token ends every block
    assert m["draft_tokens"] - m["accepted_draft_tokens"] <= m["accepted_draft_tokens"] // 4
    assert 0 < m["verify_steps"] < 40


def test_a_prediction_keeps_the_answer_and_reports_its_own_tokens(client):
    """chat (the client's own `prediction=`) and completions (in the body): the same greedy
    answer with the answer's text, an edited copy or its text parts as the prediction, and
    the prediction's tokens counted. (The tiny model's text does not tokenise back to the same
    ids -- several ids share a character -- so its predictions match only in part;
    tests/serve/test_prediction.py checks exact predictions on ids.)"""
    plain = _chat(client, "the cat sat on the mat", max_tokens=40, temperature=0)
    text = plain.choices[0].message.content
    edited = text[:10] + "XY" + text[12:]
    for pred in (text, edited, [{"type": "text", "text": text}]):
        r = _chat(client, "the cat sat on the mat", max_tokens=40, temperature=0,
                  prediction={"type": "content", "content": pred})
        assert r.choices[0].message.content == text
        d, m = r.usage.completion_tokens_details, r.usage.model_extra["macfleet"]
        assert 10 <= d.accepted_prediction_tokens <= m["accepted_draft_tokens"]
        assert d.rejected_prediction_tokens <= m["draft_tokens"] - m["accepted_draft_tokens"]
        assert m["verify_steps"] < 40 - d.accepted_prediction_tokens // 2
    full = client.completions.create(model="tiny:1", prompt="abc abc abc", max_tokens=30,
                                     temperature=0).choices[0].text
    r = client.completions.create(model="tiny:1", prompt="abc abc abc", max_tokens=30,
                                  temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": full}})
    assert r.choices[0].text == full
    assert r.usage.completion_tokens_details.accepted_prediction_tokens >= 5


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny:1"]


def test_chat_non_streaming_and_streaming_agree(client):
    r = _chat(client, "the cat sat on the mat", max_tokens=20, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and len(text) == 20  # tiny: 1 char/token
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (22, 20)
    assert u.total_tokens == 42
    d = u.completion_tokens_details
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (0, 0)
    assert 0 <= u.model_extra["macfleet"]["accepted_draft_tokens"] <= u.completion_tokens
    chunks = list(_chat(client, "the cat sat on the mat", max_tokens=20, temperature=0,
                        stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_completions_and_stop_sequence(client):
    full = client.completions.create(model="tiny:1", prompt="abc abc abc", max_tokens=30,
                                     temperature=0).choices[0].text
    assert len(full) == 30
    stop = full[10:12]
    cut = full[: full.index(stop)]
    r = client.completions.create(model="tiny:1", prompt="abc abc abc", max_tokens=30,
                                  temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny:1", prompt="abc abc abc", max_tokens=30, temperature=0, stop=stop,
        stream=True) if c.choices)
    assert s == cut


def test_seeded_sampling_repeats_and_seeds_differ(client):
    a = _chat(client, "hello", max_tokens=24, temperature=1.0, seed=5)
    b = _chat(client, "hello", max_tokens=24, temperature=1.0, seed=5)
    c = _chat(client, "hello", max_tokens=24, temperature=1.0, seed=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content


def test_concurrent_requests_equal_one_at_a_time(client, server):
    prompts = [f"prompt number {i} " * (1 + i % 4) for i in range(6)]
    alone = [_chat(client, p, max_tokens=16, temperature=0).choices[0].message.content
             for p in prompts]
    with cf.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(lambda p: _chat(client, p, max_tokens=16, temperature=0)
                               .choices[0].message.content, prompts))
    assert together == alone
    assert wait_idle(server)["active_sessions"] == 0


def test_errors_are_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "x", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                 "content": "x"}])
    bad = openai.OpenAI(base_url=server.v1, api_key="wrong", timeout=10, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
