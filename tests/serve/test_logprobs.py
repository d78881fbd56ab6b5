"""Logprobs of committed tokens: read from the verifier's own rows, so drafts (chains, trees) and
batching do not change them, and formatted the way the `openai` client reads them.

Tolerance: LOGPROB_ATOL / LOGPROB_RTOL (tests/tolerance.py). A verify block of L tokens, a tree
and a flat batch each run the verifier's forward in another shape than plain decoding's one
token per forward, which moves logits by up to ~6e-4 (two BLAS paths); log p = z - logsumexp(z)
moves by at most twice that. A logprob read at the wrong row (off by one, a draft's row, the
parent's instead of the node's) moves by O(1) on these random models.
"""

from __future__ import annotations

import concurrent.futures as cf
import math

import mlx.core as mx
import numpy as np
import pytest
from engine_parts_kit import serve_collect
from serve_testkit import start_server, stop_server
from tolerance import LOGPROB_ATOL, LOGPROB_RTOL

from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.serve.engine import BatchEngine, EngineRequest
from macfleet.serve.logprobs import chain_rows, completion_logprobs, row_logprobs, tree_rows


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny:1:64")


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def block_logprobs(logits, rows, tokens, top):
    """A block's rows built lazily and evaluated, as the engine does, then read."""
    parts = row_logprobs(logits, top)
    mx.eval(parts.arrays())
    return parts.entries(rows, tokens)


def test_block_logprobs_reads_each_token_at_its_row():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 30)).astype(np.float32) * 4
    ref = _log_softmax(z)
    got = block_logprobs(mx.array(z), [0, 3, 4], [7, 2, 29], top=4)
    for e, row, t in zip(got, [0, 3, 4], [7, 2, 29]):
        assert e.token == t and math.isclose(e.logprob, ref[row, t], abs_tol=1e-5)
        want = np.argsort(-ref[row], kind="stable")[:4]
        assert [a for a, _ in e.top] == want.tolist()  # most likely first
        assert np.allclose([lp for _, lp in e.top], ref[row, want], atol=1e-5)
    assert block_logprobs(mx.array(z), [1], [3], top=99)[0].top[-1][1] == pytest.approx(
        ref[1].min(), abs=1e-5)  # top is capped at the vocabulary
    assert chain_rows(3) == [0, 1, 2]
    assert tree_rows([2, 5], 3) == [0, 2, 5] and tree_rows([2, 5], 2) == [0, 2]


def test_completion_shape_offsets():
    from macfleet.serve.logprobs import TokenLogprob

    e = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))), TokenLogprob(2, -0.1, ((2, -0.1),))]
    out = completion_logprobs(e, lambda t: "ab"[t - 1] * t, top=1, offset=3)
    assert out == {"tokens": ["a", "bb"], "token_logprobs": [-0.5, -0.1],
                   "top_logprobs": [{"a": -0.5, "bb": -1.5}, {"bb": -0.1}],
                   "text_offset": [3, 4]}


def _serve(engine: BatchEngine, reqs: list[EngineRequest]):
    """Per request: (token ids, logprob entries, Finished); the entries follow the tokens."""
    out = serve_collect(engine, reqs)
    for (toks, lps, _), r in zip(out, reqs):
        assert [e.token for e in lps] == (toks if r.logprobs is not None else [])
    return out


def _prompts(vocab: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(4)
    rep = tuple(rng.integers(0, vocab, 6).tolist()) * 5  # repetitive: n-gram drafts accepted
    return [rep, tuple(rng.integers(0, vocab, 40).tolist()), rep[:17],
            tuple(rng.integers(0, vocab, 9).tolist())]


def _close(a, b) -> None:
    assert [e.token for e in a] == [e.token for e in b]
    np.testing.assert_allclose([e.logprob for e in a], [e.logprob for e in b],
                               atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    for x, y in zip(a, b):
        np.testing.assert_allclose([lp for _, lp in x.top], [lp for _, lp in y.top],
                                   atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)


# the model as its own draft: every greedy draft is accepted, so most tokens are committed from
# draft rows of the verify block (a chain), or from a tree's accepted path
# the fast lane keeps the tree (its accepted path is a chain's rows); both in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("proposer", [pytest.param("draft:tiny:1:64", marks=pytest.mark.slow),
                                      "ngram+draft:tiny:1:64"])
def test_logprobs_with_drafts_equal_plain_decoding_and_batched_equal_alone(tiny, proposer):
    reqs = [EngineRequest(p, GREEDY, 24, logprobs=5) for p in _prompts(tiny.vocab_size)]
    plain = [_serve(BatchEngine(tiny, proposer="none"), [r])[0] for r in reqs]
    alone = [_serve(BatchEngine(tiny, proposer=proposer, draft_tokens=4), [r])[0]
             for r in reqs]
    batched = _serve(BatchEngine(tiny, proposer=proposer, draft_tokens=4, max_active=8), reqs)
    assert sum(f.stats.accepted for _, _, f in batched) > len(reqs) * 10  # drafts committed
    for (t0, l0, _), (t1, l1, _), (t2, l2, _) in zip(plain, alone, batched):
        assert t0 == t1 == t2
        _close(l1, l0)
        _close(l2, l1)
        for e in l0:  # greedy: the committed token is the most likely one
            assert e.top[0][0] == e.token and len(e.top) == 5


def test_sampled_logprobs_are_the_models_not_the_samplers(tiny):
    """Temperature and top_p do not change the numbers (raw logprobs), only which token."""
    p = _prompts(tiny.vocab_size)[1]
    hot = SamplingParams(1.5, 0.5, seed=3)
    (toks, lps, _), = _serve(BatchEngine(tiny, proposer="ngram", draft_tokens=3),
                             [EngineRequest(p, hot, 16, logprobs=0)])
    (toks0, lps0, _), = _serve(BatchEngine(tiny, proposer="none"),
                               [EngineRequest(p, hot, 16, logprobs=0)])
    assert toks == toks0
    _close(lps, lps0)
    assert all(e.top == () for e in lps)


def test_no_logprobs_no_event(tiny):
    out = _serve(BatchEngine(tiny, proposer="ngram"), [EngineRequest((1, 2, 3), GREEDY, 5)])
    assert len(out[0][0]) == 5  # (_serve checks that no logprobs came)


# -- through the `openai` client against a real server --------------------------------------
@pytest.fixture(scope="module")
def servers():
    """The same tiny model served with drafts (itself as the draft: all accepted) and none."""
    a = start_server("--proposer", "draft:tiny:1:64", "--draft-tokens", "4", model="tiny:1:64")
    try:
        b = start_server("--proposer", "none", model="tiny:1:64")
    except Exception:
        stop_server(a)
        raise
    try:
        yield a, b
    finally:
        stop_server(a)
        stop_server(b)


def _client(s):
    import openai  # ~1.6 s an import: only the slow tests below ask for it

    return openai.OpenAI(base_url=s.v1, api_key=s.key, timeout=60, max_retries=0)


PROMPT = "abc abc abc abc abc abc abc"


def _chat_lp(c, **kw):
    r = c.chat.completions.create(model="tiny:1:64", messages=[{"role": "user",
                                                                 "content": PROMPT}],
                                  max_tokens=24, temperature=0, logprobs=True, **kw)
    return r


@pytest.mark.slow
def test_openai_chat_logprobs_drafts_equal_plain_streaming_equal_full(servers):
    drafts, plain = (_client(s) for s in servers)
    ra, rb = _chat_lp(drafts, top_logprobs=3), _chat_lp(plain, top_logprobs=3)
    a, b = ra.choices[0], rb.choices[0]
    assert a.message.content == b.message.content
    assert ra.usage.model_extra["macfleet"]["accepted_draft_tokens"] > 10  # from drafts
    la, lb = a.logprobs.content, b.logprobs.content
    assert len(la) == 24 and "".join(x.token for x in la) == a.message.content
    np.testing.assert_allclose([x.logprob for x in la], [x.logprob for x in lb],
                               atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    for x in la:
        assert len(x.top_logprobs) == 3 and x.top_logprobs[0].token == x.token
        assert x.bytes == list(x.token.encode())
    chunks = list(drafts.chat.completions.create(
        model="tiny:1:64", messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
        temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in la]
    np.testing.assert_allclose([x.logprob for x in streamed], [x.logprob for x in la],
                               atol=1e-6)  # same server, same shapes
    # without logprobs: none sent
    r = drafts.chat.completions.create(model="tiny:1:64", max_tokens=4,
                                       messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].logprobs is None


@pytest.mark.slow
def test_openai_completion_logprobs_and_batched_equal_alone(servers):
    c = _client(servers[0])

    def ask(p: str):
        return c.completions.create(model="tiny:1:64", prompt=p, max_tokens=16, temperature=0,
                                    logprobs=2).choices[0]

    prompts = [PROMPT, "hello there", "the cat sat on the mat " * 3, "xyz"]
    alone = [ask(p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(ask, prompts))
    for a, t in zip(alone, together):
        assert a.text == t.text and "".join(a.logprobs.tokens) == a.text
        np.testing.assert_allclose(t.logprobs.token_logprobs, a.logprobs.token_logprobs,
                                   atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
        assert all(len(d) <= 2 for d in a.logprobs.top_logprobs)
        assert a.logprobs.text_offset == [len(a.text[:i]) for i in range(len(a.text))]
    s = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny:1:64", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=1,
        stream=True) if ch.choices)
    assert s == alone[0].text


@pytest.mark.slow
def test_bad_logprob_fields_are_400s_and_do_not_break_the_batch(servers):
    import openai

    c = _client(servers[0])
    bad = [dict(logprobs=True, top_logprobs=21), dict(logprobs=True, top_logprobs=-1),
           dict(logprobs="yes"), dict(top_logprobs=2), dict(logprobs=1)]
    params = ["top_logprobs", "top_logprobs", "logprobs", "top_logprobs", "logprobs"]

    def good():
        return _chat_lp(c, top_logprobs=20)  # 20 alternatives of a 64-token vocabulary

    with cf.ThreadPoolExecutor(4) as ex:
        goods = [ex.submit(good) for _ in range(3)]
        for kw, param in zip(bad, params):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny:1:64", max_tokens=4,
                                          messages=[{"role": "user", "content": "x"}],
                                          extra_body=kw)
            assert e.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny:1:64", prompt="x", max_tokens=4,
                                 extra_body={"logprobs": 99})
        assert e.value.body["param"] == "logprobs"
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny:1:64", prompt="x", max_tokens=4,
                                 extra_body={"logprobs": True})
        assert e.value.body["param"] == "logprobs"
        outs = [g.result().choices[0] for g in goods]
    assert all(len(o.logprobs.content) == 24 for o in outs)
    assert all(len(x.top_logprobs) == 20 for x in outs[0].logprobs.content)
    assert len({o.message.content for o in outs}) == 1
