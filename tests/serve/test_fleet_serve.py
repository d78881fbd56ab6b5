"""`macfleet serve` in front of a real local fleet (`macfleet up`, tiny model, its own
MACFLEET_HOME so no other fleet is seen): each request goes to the verifier agent.

One fleet for the module (a fleet's start and stop cost ~10 s each): each test starts its own
server in front of it, and its prompts share no prefix of MIN_CACHED_PREFIX tokens with
another test's, so the agent's prompt cache (kept across tests) answers no test's first
request. The one-at-a-time verifier needs a fleet of its own (`--batch-sessions 0`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import openai
import pytest
from serve_testkit import start_server, stop_server

from macfleet.fleet.serve_watch import fetch_batch

pytestmark = pytest.mark.slow  # starts a local fleet (agent processes) and a server


def _cli(*args: str, env: dict, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "macfleet", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def fleet_env(tmp_path_factory):
    env = {**os.environ, "MACFLEET_HOME": str(tmp_path_factory.mktemp("fleet") / "home")}
    r = _cli("up", "--model", "tiny:1", "--agents", "2", "--no-pin", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    try:
        yield env
    finally:
        _cli("down", env=env, timeout=30)


@pytest.fixture(scope="module")
def alone(fleet_env) -> str:
    """The verifier alone's 12 greedy tokens for "hello hello" (`generate --local`), once for
    both tests that compare with it."""
    r = _cli("generate", "hello hello", "--model", "tiny:1", "--local", "--proposer", "none",
             "--max-tokens", "12", "--json", env=fleet_env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["text"]


def test_serve_forwards_to_the_fleet_verifier(fleet_env, alone, monkeypatch):
    monkeypatch.setenv("MACFLEET_HOME", fleet_env["MACFLEET_HOME"])
    s = start_server("--proposer", "ngram", key=None, local=False)
    try:
        assert "verifier agent" in s.banner
        # one line says which agents it fronts (cli/where.py), before the banner
        (where,) = [ln for ln in s.before if ln.startswith("macfleet serve: fleet ")]
        assert " verifier " in where and "proposers " in where, s.before
        c = openai.OpenAI(base_url=s.v1, api_key="none", timeout=60, max_retries=0)
        r = c.chat.completions.create(model="tiny:1", max_tokens=12, temperature=0,
                                      messages=[{"role": "user", "content": "hello hello"}])
        text = r.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny:1", max_tokens=12, temperature=0, stream=True,
            messages=[{"role": "user", "content": "hello hello"}]) if ch.choices)
        batch = fetch_batch(s.base, timeout_s=5).batch  # what `dash --serve` shows
    finally:
        stop_server(s)
    assert text == streamed == alone
    assert r.usage.completion_tokens == 12
    # the verifier agent's own continuous batch ran the two requests (its iterations count since
    # the agent started: other tests' requests add to them; the sessions are this server's)
    assert batch.mode == "fleet" and batch.alive and batch.iterations >= 24
    assert batch.recent and all(it.sessions == 1 for it in batch.recent)
    assert [x.state for x in batch.sessions] == ["done", "done"]
    assert all(x.generated == 12 and x.ttft_ms > 0 for x in batch.sessions)


def test_auto_is_chosen_on_the_fleet_verifier(fleet_env, alone, monkeypatch):
    """`serve`'s default drafter in front of a fleet without draft-model agents: `auto` goes to
    the verifier agent as it is (it chooses among its own drafters, as `generate` through a
    fleet), not the bench record's winner on the proposer agent; the answer is the verifier
    alone's."""
    monkeypatch.setenv("MACFLEET_HOME", fleet_env["MACFLEET_HOME"])
    s = start_server(key=None, local=False)
    try:
        (where,) = [ln for ln in s.before if ln.startswith("macfleet serve: fleet ")]
        assert "proposers none (the verifier drafts for itself)" in where, where
        c = openai.OpenAI(base_url=s.v1, api_key="none", timeout=60, max_retries=0)
        r = c.chat.completions.create(model="tiny:1", max_tokens=12, temperature=0,
                                      messages=[{"role": "user", "content": "hello hello"}])
    finally:
        stop_server(s)
    assert r.choices[0].message.content == alone


def test_a_prediction_travels_to_the_fleet_verifier(fleet_env, monkeypatch):
    """Predicted Outputs through a fleet as in serve --local: the verifier agent's batch drafts
    from the prediction beside the proposer agent's n-gram drafts (one tree); the answer is the
    one without a prediction, and the prediction's tokens are counted. Dropping the prediction
    anywhere on the way leaves accepted_prediction_tokens at 0."""
    monkeypatch.setenv("MACFLEET_HOME", fleet_env["MACFLEET_HOME"])
    s = start_server("--proposer", "ngram", key=None, local=False)
    ask = [{"role": "user", "content": "one two three four"}]
    try:
        c = openai.OpenAI(base_url=s.v1, api_key="none", timeout=60, max_retries=0)
        plain = c.chat.completions.create(model="tiny:1", max_tokens=40, temperature=0,
                                          messages=ask)
        text = plain.choices[0].message.content
        r = c.chat.completions.create(model="tiny:1", max_tokens=40, temperature=0,
                                      messages=ask,
                                      prediction={"type": "content", "content": text})
    finally:
        stop_server(s)
    assert r.choices[0].message.content == text
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    d, m = r.usage.completion_tokens_details, r.usage.model_extra["macfleet"]
    assert d.accepted_prediction_tokens >= 5  # tiny's text re-tokenises only in part
    assert m["verify_steps"] < plain.usage.model_extra["macfleet"]["verify_steps"]


def test_a_full_one_at_a_time_verifier_makes_requests_wait_not_fail(tmp_path, monkeypatch):
    """A verifier agent that runs one session at a time (--batch-sessions 0, as a sharded one
    does) answers `busy` past its queue of 8: the server keeps those requests waiting and
    retries; all 12 concurrent ones are answered. Its own fleet: the module's verifier batches."""
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "MACFLEET_HOME": str(tmp_path / "home")}
    r = _cli("up", "--model", "tiny:1", "--agents", "2", "--no-pin", "--batch-sessions", "0",
             env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    monkeypatch.setenv("MACFLEET_HOME", env["MACFLEET_HOME"])
    s = start_server("--proposer", "none", key=None, local=False)
    try:
        c = openai.OpenAI(base_url=s.v1, api_key="none", timeout=120, max_retries=0)

        def ask(i: int) -> int:
            return c.completions.create(model="tiny:1", prompt=f"w{i} w{i + 1}", max_tokens=40,
                                        temperature=0).usage.completion_tokens

        with ThreadPoolExecutor(12) as ex:
            assert list(ex.map(ask, range(12))) == [40] * 12
    finally:
        stop_server(s)
        _cli("down", env=env, timeout=30)


def test_logprobs_cached_tokens_and_response_format_through_the_fleet(fleet_env, monkeypatch):
    """Protocol 4: the verifier agent's batch scores each committed token and masks its rows
    with a request's grammar; the wire carries the logprobs and the prompt cache's saved
    tokens back. The same greedy request through the
    fleet and through `serve --local` gives the same tokens and logprobs ("greedy margin":
    another process with its own BLAS threads, so logprobs within the logit bounds)."""
    from tolerance import LOGPROB_ATOL

    monkeypatch.setenv("MACFLEET_HOME", fleet_env["MACFLEET_HOME"])
    # not "one two three four ...": the prediction test's prompt would be a cached prefix
    history = [{"role": "user", "content": "seven six five four three two one"}]

    def ask(s):
        c = openai.OpenAI(base_url=s.v1, api_key="none", timeout=60, max_retries=0)
        first = c.chat.completions.create(model="tiny:1", max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=3, messages=history)
        turn2 = [*history, {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
        second = c.chat.completions.create(model="tiny:1", max_tokens=4, temperature=0,
                                           messages=turn2)
        streamed = [ch for ch in c.chat.completions.create(
            model="tiny:1", max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
            stream=True, messages=history) if ch.choices]
        return first, second, streamed

    regex = {"type": "regex", "regex": "(one|two)( (one|two)){3,5}"}

    def constrained(s):
        c = openai.OpenAI(base_url=s.v1, api_key="none", timeout=60, max_retries=0)
        good = c.chat.completions.create(model="tiny:1", max_tokens=30, temperature=0,
                                         messages=history, extra_body={"response_format": regex})
        with pytest.raises(openai.BadRequestError) as bad:
            c.chat.completions.create(model="tiny:1", max_tokens=5, messages=history,
                                      extra_body={"response_format": {"type": "regex",
                                                                      "regex": "(unclosed"}})
        return good.choices[0], bad.value

    fleet = start_server("--proposer", "ngram", key=None, local=False)
    try:
        first, second, streamed = ask(fleet)
        fleet_json, fleet_bad = constrained(fleet)
    finally:
        stop_server(fleet)
    local = start_server("--proposer", "none", key=None)
    try:
        want = ask(local)[0]
        local_json = constrained(local)[0]
    finally:
        stop_server(local)
    # response_format through the fleet: the agent's batch masks its rows (greedy margin)
    assert re.fullmatch(regex["regex"], fleet_json.message.content)
    assert fleet_json.message.content == local_json.message.content
    assert fleet_json.finish_reason == "stop"
    assert "response_format" in str(fleet_bad)
    got, ref = first.choices[0].logprobs.content, want.choices[0].logprobs.content
    assert [x.token for x in got] == [x.token for x in ref] and len(got) == 10
    for a, b in zip(got, ref):
        assert abs(a.logprob - b.logprob) < LOGPROB_ATOL and a.logprob <= 0
        assert len(a.top_logprobs) == 3
        assert [t.token for t in a.top_logprobs][:1] == [a.token]  # greedy: the top one
    flat = [x for ch in streamed if ch.choices[0].logprobs is not None
            for x in ch.choices[0].logprobs.content or []]
    assert [x.token for x in flat] == [x.token for x in got]  # streamed: the same entries
    assert all(abs(x.logprob - y.logprob) < LOGPROB_ATOL for x, y in zip(flat, got))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > len(history[0]["content"]) // 4
