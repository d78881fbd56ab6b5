"""The prompt cache across requests: LRU within a byte budget, the longest cached prefix reused,
greedy answers identical with and without it, and the saving reported (usage, batch view)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from serve_testkit import start_server, stop_server

from macfleet.engine.events import Finished, TokensCommitted
from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY
from macfleet.serve.engine import BatchEngine, EngineRequest
from macfleet.serve.prompt_cache import PromptCache, PromptReused, common_prefix_len


def _kv(n: int, layers: int = 2, fill: float = 0.0):
    return tuple((mx.full((2, n, 4), fill), mx.full((2, n, 4), fill)) for _ in range(layers))


def test_lookup_finds_the_longest_prefix_and_never_the_last_token():
    pc = PromptCache(1 << 20, min_tokens=4)
    pc.insert(list(range(10)), _kv(10, fill=1.0))
    pc.insert([0, 1, 2, 3, 4, 99, 98, 97], _kv(8, fill=2.0))
    n, kv = pc.lookup(list(range(20)))
    assert n == 10 and float(kv[0][0][0, 0, 0]) == 1.0 and kv[1][1].shape == (2, 10, 4)
    n, kv = pc.lookup([0, 1, 2, 3, 4, 99, 98, 97, 5])
    assert n == 8 and float(kv[0][0][0, 0, 0]) == 2.0
    assert pc.lookup(list(range(10)))[0] == 9  # prompt[:-1]: its last token is always fed
    assert pc.lookup([0, 1, 2, 7, 7])[1] is None  # 3 < min_tokens
    assert pc.lookup([5, 6, 7, 8, 9])[1] is None
    st = pc.stats()
    assert (st.lookups, st.hits, st.saved_tokens, st.entries) == (5, 3, 27, 2)


def test_lru_within_the_byte_budget_and_extensions_replace_their_prefix():
    one = sum(k.nbytes + v.nbytes for k, v in _kv(10))
    pc = PromptCache(3 * one, min_tokens=4)
    for i in range(3):
        assert pc.insert([i] * 10, _kv(10))
    pc.lookup([0] * 11)  # 0 is now the most recently used
    assert pc.insert([3] * 10, _kv(10))  # evicts 1, the least recently used
    assert pc.lookup([1] * 11)[1] is None and pc.lookup([0] * 11)[0] == 10
    assert pc.bytes <= pc.max_bytes and len(pc) == 3
    assert pc.insert([0] * 10 + [5] * 6, _kv(16)) or True  # extends [0]*10: replaces it
    assert all(common_prefix_len(np.array([0] * 10), e.tokens) < 10 or len(e.tokens) == 16
               for e in pc._entries.values())
    assert not pc.insert(list(range(100)), _kv(100))  # larger than the whole budget
    assert not pc.insert([1, 2], _kv(2))  # below min_tokens
    with pytest.raises(ValueError):
        PromptCache(0)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny:1:64")


def _run(engine, prompts, max_tokens=12):
    """Requests one after another (turns): per request (ids, tokens reused)."""
    out = []
    for p in prompts:
        got, reused = [], [0]

        def emit(ev):
            if isinstance(ev, TokensCommitted):
                got.extend(ev.tokens)
            elif isinstance(ev, PromptReused):
                reused[0] = ev.tokens
            elif isinstance(ev, Finished):
                assert list(ev.token_ids) == got

        engine.submit(EngineRequest(tuple(p), GREEDY, max_tokens), emit)
        engine.run_until_idle()
        out.append((got, reused[0]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("proposer", [pytest.param("none", marks=pytest.mark.slow),  # fast lane:
                                      "draft:tiny:1:64"])  # the cache under drafts and rollback
def test_multi_turn_greedy_identical_with_and_without_the_cache(tiny, proposer):
    rng = np.random.default_rng(2)
    history = rng.integers(0, 64, 40).tolist()
    cached = BatchEngine(tiny, proposer=proposer, draft_tokens=3, prompt_cache_bytes=64 << 20)
    plain = BatchEngine(tiny, proposer=proposer, draft_tokens=3)
    turns, saved = [], []
    for turn in range(4):  # each turn: the whole history, the last answer, a new message
        (a, reused), = _run(cached, [history])
        (b, _), = _run(plain, [history])
        assert a == b
        turns.append(a)
        saved.append(reused)
        history = [*history, *a, *rng.integers(0, 64, 7).tolist()]
    assert saved[0] == 0 and all(s >= 40 for s in saved[1:])  # the whole earlier context
    # turn 2 on reused all of turn 1's prompt and answer but its last token (never cached)
    st = cached.prompt_cache.stats()
    assert st.hits == 3 and st.saved_tokens == sum(saved)
    prefill = sum(r.prefill_tokens for r in cached.history)
    assert prefill < sum(r.prefill_tokens for r in plain.history) - sum(saved) + 1
    # a long prompt (its own store) takes a cached prefix too
    long = [*history, *rng.integers(0, 64, 600).tolist()]
    (a, reused), = _run(cached, [long], 6)
    (b, _), = _run(plain, [long], 6)
    assert a == b and reused == len(history) - 8  # turn 4: its prompt and answer but the last


def test_invariant_mode_has_no_prompt_cache(tiny):
    assert BatchEngine(tiny, proposer="none", invariant=True,
                       prompt_cache_bytes=1 << 20).prompt_cache is None


@pytest.mark.slow
def test_openai_multi_turn_cached_tokens_and_identical_answers():
    import openai  # ~1.6 s an import: the module's other tests need none

    a = start_server("--prompt-cache-mb", "64", model="tiny:1:64")
    try:
        b = start_server("--prompt-cache-mb", "0", model="tiny:1:64")
    except Exception:
        stop_server(a)
        raise
    try:
        ca, cb = (openai.OpenAI(base_url=s.v1, api_key=s.key, timeout=60, max_retries=0)
                  for s in (a, b))
        msgs = [{"role": "system", "content": "you are a helpful assistant. " * 4}]
        cached = []
        for turn in range(3):
            msgs.append({"role": "user", "content": f"question number {turn}, please?"})
            ra, rb = (c.chat.completions.create(model="tiny:1:64", messages=msgs,
                                                max_tokens=10, temperature=0)
                      for c in (ca, cb))
            assert ra.choices[0].message.content == rb.choices[0].message.content
            assert rb.usage.prompt_tokens_details.cached_tokens == 0
            cached.append(ra.usage.prompt_tokens_details.cached_tokens)
            msgs.append({"role": "assistant", "content": ra.choices[0].message.content})
        assert cached[0] == 0 and all(c > 100 for c in cached[1:])
        view = ca._client.get(a.base + "/v1/macfleet/batch",
                              headers=a.headers()).json()["prompt_cache"]
        assert view["hits"] == 2 and view["saved_tokens"] == sum(cached)
        assert 0 < view["bytes"] <= view["max_bytes"] == 64 << 20
        assert ca._client.get(b.base + "/v1/macfleet/batch",
                              headers=b.headers()).json()["prompt_cache"] is None
    finally:
        stop_server(a)
        stop_server(b)


def test_entries_answer_only_their_own_partition():
    pc = PromptCache(1 << 20, min_tokens=4)
    pc.insert(list(range(10)), _kv(10, fill=1.0), partition="alice")
    assert pc.lookup(list(range(20)), "bob") == (0, None)
    assert pc.lookup(list(range(20)))[1] is None  # the shared partition ("") neither
    assert pc.lookup(list(range(20)), "alice")[0] == 10
    pc.insert(list(range(12)), _kv(12, fill=2.0), partition="bob")  # extends only bob's
    assert len(pc) == 2 and pc.lookup(list(range(20)), "alice")[0] == 10


@pytest.mark.parametrize("parts, shared", [(("a", "a"), True), (("a", "b"), False)])
def test_live_sessions_share_prompt_prefixes_only_within_a_partition(tiny, parts, shared):
    prompt = tuple(np.random.default_rng(3).integers(0, 64, 60).tolist())
    engine = BatchEngine(tiny, proposer="none", prompt_cache_bytes=64 << 20)
    reused = {}
    def emit(i: int):
        return lambda ev: isinstance(ev, PromptReused) and reused.update({i: ev.tokens})

    for i, part in enumerate(parts):
        engine.submit(EngineRequest(prompt, GREEDY, 4, partition=part), emit(i))
    engine.run_until_idle()
    assert bool(reused.get(1, 0)) == shared, reused
