"""One request through the serving engine (serve/one.py) as a stream of events: consistency,
limits, EOS, a proposer that dies.

Token ids: the "greedy margin" rule of tests/tolerance.py (the engine's blocks vs mlx-lm's
plain decoding); "same path" for a seeded run repeated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from engine_testkit import finished, mlx_lm_greedy

from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.proposers.base import ProposerFailed, sanitize_draft
from macfleet.engine.proposers import Draft, Proposer, make_proposer
from macfleet.engine.proposers.ngram import NgramProposer
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.text import TextDelta
from macfleet.serve.one import decode_ids, generate_one

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
N = 40


@pytest.fixture(scope="module")
def ref(tiny) -> list[int]:
    return mlx_lm_greedy(tiny.model, PROMPT, N)


class Oracle(Proposer):
    """Knows the verifier's greedy continuation; proposes `right` correct tokens, then wrong ones.

    `right=None` proposes only correct tokens: every draft is accepted.
    """

    name = "oracle"

    def __init__(self, truth: Sequence[int], vocab: int, right: int | None = None) -> None:
        self.truth, self.vocab, self.right = list(truth), vocab, right
        self.calls = 0
        self.started = self.closed = 0

    def start(self, params):
        super().start(params)
        self.started += 1

    def close(self):
        self.closed += 1

    def propose(self, context, k):
        self.calls += 1
        pos = len(context) - len(PROMPT)
        good = self.truth[pos : pos + k]
        if self.right is not None:
            good = good[: self.right]
            good += [(self.truth[pos + len(good)] + 1) % self.vocab] if pos + len(good) < len(
                self.truth) else []
            good += [0] * (k - len(good))
        return Draft(tuple(good[:k]))


class DiesAfter(Proposer):
    """Wraps a proposer and raises ProposerFailed on its n-th call (a dead remote peer)."""

    name = "dies"

    def __init__(self, inner: Proposer, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0

    def start(self, params):
        self.inner.start(params)

    def propose(self, context, k):
        self.calls += 1
        if self.calls >= self.n:
            raise ProposerFailed("peer went away")
        return self.inner.propose(context, k)


def run(tiny, proposer, k=4, max_tokens=N, eos_ids=frozenset(), params=None, prompt=PROMPT):
    kw = {"params": params} if params is not None else {}
    return list(decode_ids(tiny, prompt, proposer, draft_tokens=k, max_tokens=max_tokens,
                           eos_ids=eos_ids, **kw))


def check_consistent(events) -> Finished:
    """The invariants every event stream must satisfy."""
    fin = events[-1]
    assert isinstance(fin, Finished)
    assert sum(isinstance(e, Finished) for e in events) == 1
    committed = [t for e in events if isinstance(e, TokensCommitted) for t in e.tokens]
    assert tuple(committed) == fin.token_ids
    blocks = [e for e in events if isinstance(e, BlockDone)]
    s = fin.stats
    assert s.tokens == len(fin.token_ids)
    assert s.blocks == len(blocks) == (blocks[-1].block if blocks else 0)
    assert [b.block for b in blocks] == list(range(1, len(blocks) + 1))
    assert s.drafted == sum(b.drafted for b in blocks)
    assert s.accepted == sum(b.accepted for b in blocks)
    assert all(0 <= b.accepted <= b.drafted <= b.k for b in blocks)
    assert sum(b.committed for b in blocks) == s.tokens
    assert s.acceptance == (s.accepted / s.drafted if s.drafted else 0.0)
    assert 0.0 <= s.acceptance <= 1.0
    if s.drafted:
        assert sum(s.accepted_hist) == sum(1 for b in blocks if b.drafted > 0)
        assert sum(i * c for i, c in enumerate(s.accepted_hist)) == s.accepted
        assert s.accepted_hist[-1] > 0  # trailing zeros are trimmed
        assert s.mean_accepted == pytest.approx(
            s.accepted / sum(1 for b in blocks if b.drafted > 0))
    else:
        assert s.accepted_hist == ()
    # the order: per block, its BlockDone immediately followed by its TokensCommitted (only
    # when it committed something, never empty), blocks in order, Finished last
    expect = 0
    owed = 0  # tokens the last BlockDone said it committed, not yet seen
    for e in events[:-1]:
        assert not isinstance(e, Finished)
        if isinstance(e, TokensCommitted):
            assert owed and e.tokens and e.block == expect, (e, expect)
            assert len(e.tokens) == owed, e
            owed = 0
        else:
            assert isinstance(e, BlockDone) and e.block == expect + 1, (e, expect)
            assert not owed, f"a BlockDone without its TokensCommitted before {e}"
            expect, owed = e.block, e.committed
    assert not owed, "a BlockDone without its TokensCommitted"
    d = s.to_dict()
    assert d["tokens"] == s.tokens and d["acceptance"] == s.acceptance
    assert isinstance(d["accepted_hist"], list)
    return fin


@pytest.mark.slow
@pytest.mark.parametrize("right", [None, 0, 1, 2, 3])
def test_exact_accept_pattern(tiny, ref, right):
    """An oracle that is right for exactly `right` tokens per block: accepted == right."""
    events = run(tiny, Oracle(ref, tiny.vocab_size, right), k=4)
    fin = check_consistent(events)
    assert list(fin.token_ids) == ref
    blocks = [e for e in events if isinstance(e, BlockDone)]
    want = 4 if right is None else right
    for b in blocks:
        if b.drafted == 4:  # full blocks (the last one may be shorter)
            assert b.accepted == want
            assert b.committed == want + 1
    if right is None:
        assert fin.stats.acceptance == 1.0
        assert fin.stats.blocks == -(-N // 5)


# every proposer at k=3, and each other k once, in the fast lane; the rest of the matrix runs
# in the default suite (docs/testing.md "Fast lane, second round")
@pytest.mark.slow
@pytest.mark.parametrize("k, proposer", [
    (k, p) if k == 3 or (k, p) in ((1, "ngram"), ("auto", "draft:tiny:2:64"))
    else pytest.param(k, p, marks=pytest.mark.slow)
    for k in (1, 3, "auto") for p in ("none", "ngram", "draft:tiny:2:64", "layerskip:2")])
def test_event_stream_is_consistent(tiny, ref, proposer, k):
    events = run(tiny, make_proposer(proposer, tiny), k=k if proposer != "none" else 0)
    fin = check_consistent(events)
    assert list(fin.token_ids) == ref
    assert fin.stats.proposer == ("none" if proposer == "none" else
                                  make_proposer(proposer, tiny).name)


@pytest.mark.slow
def test_event_stream_is_consistent_when_sampling(tiny):
    for proposer in (make_proposer("draft:tiny:2:64", tiny), NgramProposer()):
        events = run(tiny, proposer, k=3, params=SamplingParams(1.5, seed=4))
        fin = check_consistent(events)
        assert len(fin.token_ids) == N
        assert all(0 <= t < tiny.vocab_size for t in fin.token_ids)


@pytest.mark.slow
def test_sampling_with_a_seed_is_reproducible(tiny):
    p = SamplingParams(1.5, top_p=0.9, seed=11)
    a = finished(run(tiny, make_proposer("draft:tiny:2:64", tiny), k=3, params=p))
    b = finished(run(tiny, make_proposer("draft:tiny:2:64", tiny), k=3, params=p))
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("max_tokens", [0, 1, 2, 3, 5, 6, 17])
@pytest.mark.parametrize("k", [0, 4, 8])
def test_max_tokens_is_exact(tiny, ref, max_tokens, k):
    """Even when every draft is accepted, a block never overshoots max_tokens."""
    events = run(tiny, Oracle(ref, tiny.vocab_size), k=k, max_tokens=max_tokens)
    fin = check_consistent(events)
    assert list(fin.token_ids) == ref[:max_tokens]
    assert fin.stats.finish_reason == "length"
    assert all(b.k <= max_tokens - 1 for b in events if isinstance(b, BlockDone))


@pytest.mark.parametrize("proposer", ["oracle", "none", "ngram"])
def test_eos_stops_generation(tiny, ref, proposer):
    """EOS = a token the verifier emits mid-stream; it can land inside an accepted draft."""
    eos_pos = next(i for i in range(5, N) if ref[i] not in ref[:i])
    eos = ref[eos_pos]
    prop = {"oracle": Oracle(ref, tiny.vocab_size), "none": None,
            "ngram": NgramProposer()}[proposer]
    events = run(tiny, prop, k=4, eos_ids=frozenset({eos}))
    fin = check_consistent(events)
    assert list(fin.token_ids) == ref[:eos_pos]  # EOS itself is not part of the output
    assert fin.stats.finish_reason == "stop"
    # nothing is committed after EOS
    assert isinstance(events[-2], BlockDone)


def test_eos_as_the_first_token(tiny, ref):
    events = run(tiny, None, k=0, eos_ids=frozenset({ref[0]}))
    fin = check_consistent(events)
    assert fin.token_ids == () and fin.stats.finish_reason == "stop"
    assert not any(isinstance(e, TokensCommitted) for e in events)


@pytest.mark.slow
@pytest.mark.parametrize("dies_at", [1, 3, 6])
@pytest.mark.parametrize("inner", ["oracle", "draft"])
def test_proposer_failure_mid_generation(tiny, ref, dies_at, inner):
    base = Oracle(ref, tiny.vocab_size) if inner == "oracle" else make_proposer(
        "draft:tiny:2:64", tiny)
    dying = DiesAfter(base, dies_at)
    events = run(tiny, dying, k=3)
    fin = check_consistent(events)
    assert list(fin.token_ids) == ref  # no token lost or duplicated
    assert dying.calls == dies_at  # never asked again after it failed
    blocks = [e for e in events if isinstance(e, BlockDone)]
    assert all(b.drafted == 0 for b in blocks[dies_at - 1 :])  # plain decoding after
    if inner == "oracle":
        assert fin.stats.accepted == 3 * (dies_at - 1)


def test_proposer_is_started_and_closed(tiny, ref):
    o = Oracle(ref, tiny.vocab_size)
    run(tiny, o, k=2, max_tokens=5)
    assert (o.started, o.closed) == (1, 1)
    # closed even when the consumer stops early
    o2 = Oracle(ref, tiny.vocab_size)
    gen = decode_ids(tiny, PROMPT, o2, draft_tokens=2, max_tokens=N)
    next(gen)
    gen.close()
    assert o2.closed == 1


def test_one_token_prompt(tiny):
    fin = check_consistent(run(tiny, NgramProposer(), k=3, prompt=[7], max_tokens=10))
    assert list(fin.token_ids) == mlx_lm_greedy(tiny.model, [7], 10)


def test_sanitize_draft():
    d = Draft((1, 2, 3, 70, 4))
    assert sanitize_draft(d, 10, 64).tokens == (1, 2, 3)
    assert sanitize_draft(d, 2, 64).tokens == (1, 2)
    assert sanitize_draft(Draft((1, 2)), 4, 64) == Draft((1, 2))
    ok = Draft((1, 2, 3), probs=np.full((3, 4), 0.25, dtype=np.float32))
    kept = sanitize_draft(ok, 4, 4)
    assert kept.tokens == ok.tokens and kept.probs.dtype == np.float64
    np.testing.assert_array_equal(kept.probs, ok.probs)
    short = sanitize_draft(ok, 2, 4)  # truncated with its probabilities
    assert short.tokens == (1, 2) and short.probs.shape == (2, 4)
    assert sanitize_draft(Draft((1, 2), probs=ok.probs[:2] * 2), 4, 4).probs is None
    assert sanitize_draft(Draft((1, 2), probs=ok.probs[:1]), 4, 4).probs is None  # too few rows


def test_generate_local_text_path(tiny):
    """The text wrapper on a tiny model (character tokenizer, no chat template)."""
    events = list(generate_one(tiny, "hello world", proposer="ngram", max_tokens=15))
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.stats.tokens == 15
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert tuple(t for d in deltas for t in d.tokens) == fin.token_ids
    assert "".join(d.text for d in deltas) == tiny.tokenizer.decode(list(fin.token_ids))
