"""KV rollback: dropping rejected draft tokens is exact and O(1); proposer caches reuse prefixes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macfleet.engine.models import load_model
from macfleet.engine.prefix import common_prefix
from macfleet.engine.proposers.model_draft import LayerSkipModel, ModelProposer
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.verifier import Verifier

PROMPT = [5, 17, 3, 42, 8, 8, 21, 60, 1]

from tolerance import (LOGIT_ATOL, LOGIT_RTOL, LOGPROB_ATOL,  # why: tests/tolerance.py; a
                       LOGPROB_RTOL)  # wrong rollback or prefix moves logits by O(1) (see the
# negative checks below)


def test_rollback_then_forward_equals_never_fed(tiny):
    fresh = Verifier(tiny.model)
    fresh.prefill(PROMPT[:-1])
    want = np.array(fresh.forward([PROMPT[-1], 11, 12]))

    v = Verifier(tiny.model)
    v.prefill(PROMPT[:-1])
    rejected = np.array(v.forward([PROMPT[-1], 30, 31, 32, 33]))  # a 4-token draft
    assert v.offset == len(PROMPT) + 4
    v.rollback(4)  # all four drafts rejected
    assert v.offset == len(PROMPT)
    got = np.array(v.forward([11, 12]))
    np.testing.assert_allclose(got, want[1:], rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
    # the first row scored before the rejected drafts was already right
    np.testing.assert_allclose(rejected[0], want[0], rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
    # and the test is sensitive: keeping the rejected tokens changes the logits
    v2 = Verifier(tiny.model)
    v2.prefill(PROMPT[:-1])
    v2.forward([PROMPT[-1], 30, 31, 32, 33])
    assert not np.allclose(np.array(v2.forward([11, 12])), want[1:], atol=LOGIT_ATOL,
                           rtol=LOGIT_RTOL)


def test_partial_rollback_matches_fresh_prefix(tiny):
    """Accept 2 of 4 drafts: the cache equals having fed exactly the accepted tokens."""
    v = Verifier(tiny.model)
    v.prefill(PROMPT[:-1])
    v.forward([PROMPT[-1], 30, 31, 32, 33])
    v.rollback(2)
    got = np.array(v.forward([7]))

    fresh = Verifier(tiny.model)
    fresh.prefill(PROMPT[:-1])
    want = np.array(fresh.forward([PROMPT[-1], 30, 31, 7]))[-1:]
    np.testing.assert_allclose(got, want, rtol=LOGIT_RTOL, atol=LOGIT_ATOL)


def test_rollback_is_o1(tiny):
    """Rolling back moves the offset only: the key/value buffers are the same arrays."""
    v = Verifier(tiny.model)
    v.prefill(PROMPT)
    v.forward([1, 2, 3, 4, 5])
    mx.eval([c.state for c in v.cache])
    before = [(id(c.keys), id(c.values), c.keys.shape, c.offset) for c in v.cache]
    v.rollback(3)
    after = [(id(c.keys), id(c.values), c.keys.shape, c.offset) for c in v.cache]
    for (k0, v0, s0, o0), (k1, v1, s1, o1) in zip(before, after):
        assert (k0, v0, s0) == (k1, v1, s1)  # no reallocation, no copy
        assert o1 == o0 - 3
    assert v.offset == len(PROMPT) + 2


@pytest.mark.parametrize("n", [-1, 100])
def test_rollback_beyond_offset_raises(tiny, n):
    v = Verifier(tiny.model)
    v.prefill(PROMPT)
    with pytest.raises(ValueError, match="roll back"):
        v.rollback(n)
    assert v.offset == len(PROMPT)  # nothing was dropped
    v.rollback(len(PROMPT))  # exactly everything is allowed
    assert v.offset == 0


def test_rollback_of_nothing_is_a_no_op(tiny):
    """A block whose drafts were all accepted rolls back 0 entries: allowed, and the cache
    (offset and the next logits) is as if it had not been called."""
    import mlx.core as mx

    v, ref = Verifier(tiny.model), Verifier(tiny.model)
    v.prefill(PROMPT)
    ref.prefill(PROMPT)
    v.rollback(0)
    assert v.offset == len(PROMPT)
    assert mx.array_equal(v.forward([3, 4]), ref.forward([3, 4]))
    empty = Verifier(tiny.model)
    empty.rollback(0)  # even on an empty cache
    assert empty.offset == 0


def test_an_untrimmable_cache_is_refused_by_name(tiny):
    """A model whose cache cannot roll back (a recurrent state, say) would keep rejected
    drafts: the verifier refuses it up front, naming the cache types that cannot."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    from macfleet.engine.verifier import CacheError

    class Recurrent:
        args = tiny.model.args

        def make_cache(self):
            return [KVCache(), ArraysCache(1), ArraysCache(1)]

    with pytest.raises(CacheError) as e:
        Verifier(Recurrent())
    assert str(e.value) == ("speculative decoding needs a trimmable KV cache; this model uses "
                            "['ArraysCache']")


def test_reset_forgets_everything(tiny):
    import mlx.core as mx

    v, fresh = Verifier(tiny.model), Verifier(tiny.model)
    v.prefill(PROMPT)
    v.reset()
    assert v.offset == 0
    assert mx.array_equal(v.forward([3, 4]), fresh.forward([3, 4]))


def test_prefill_chunks_match_one_shot(tiny):
    """Chunked prefill (the prompt path) equals one forward over the whole prompt."""
    a = Verifier(tiny.model, prefill_step=2)
    a.prefill(PROMPT[:-1])
    b = Verifier(tiny.model)
    want = np.array(b.forward(PROMPT))[-1]
    np.testing.assert_allclose(np.array(a.forward(PROMPT[-1:]))[0], want, rtol=LOGIT_RTOL,
                               atol=LOGIT_ATOL)


@pytest.mark.parametrize("which", ["draft", "layerskip"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, seed=3)],
                         ids=["greedy", "sampling"])
def test_model_proposer_prefix_reuse_equals_fresh(tiny, which, params):
    def new() -> ModelProposer:
        model = load_draft(which, tiny)
        p = ModelProposer(model, which)
        p.start(params)
        return p

    a = [5, 17, 3, 42, 8, 8, 21, 60, 1, 9, 9]
    b = a[:6] + [33, 34, 35]  # diverges from a at position 6
    c = b + [36]  # extends b by one token
    reused = new()
    reused.propose(a, 4)
    assert reused._cached[: len(a)] == a
    for ctx in (b, c, b[:3], a):  # diverge, extend, shrink, go back
        fresh = new()
        want = fresh.propose(ctx, 4)
        got = reused.propose(ctx, 4)
        if params.greedy:
            # ids exactly: reuse feeds only the new suffix, fresh the whole context (another
            # BLAS code path); greedy argmax is not moved by the ~5e-4 of tests/tolerance.py
            # unless two logits are that close to a tie (deterministic: a fail, not a flake)
            assert got.tokens == want.tokens and got.probs is None
        else:  # the sampled tokens use different random draws; the distributions must match
            assert got.probs.shape == (4, tiny.vocab_size)
            np.testing.assert_allclose(np.log(got.probs[0]), np.log(want.probs[0]),
                                       rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL)
            # and the check is sensitive: another last token moves the distribution
            other = new().propose(list(ctx[:-1]) + [(ctx[-1] + 1) % tiny.vocab_size], 4)
            assert not np.allclose(np.log(other.probs[0]), np.log(want.probs[0]),
                                   rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL)
        assert reused._cached[: len(ctx)] == list(ctx)
        assert reused._cache[0].offset == len(reused._cached)


def load_draft(which: str, tiny):
    """A separate tiny draft model, or the verifier's first two layers."""
    if which == "layerskip":
        return LayerSkipModel(tiny.model, 2)
    return load_model("tiny:2:64").model


def test_model_proposer_reuses_its_cache(tiny):
    """Proposing for a context that extends the last one only feeds the new tokens."""
    p = ModelProposer(load_model("tiny:2:64").model, "draft")
    p.start(GREEDY)
    ctx = [5, 17, 3, 42, 8]
    d = p.propose(ctx, 3)
    assert p._cache[0].offset == len(ctx) + 2  # drafted tokens but the last were fed
    fed: list[int] = []
    orig = p._step
    p._step = lambda toks: (fed.append(len(toks)), orig(toks))[1]
    p.propose(ctx + [d.tokens[0], 9], 3)
    assert fed[0] == 1  # only the token after the common prefix, not the whole context


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([], [1]) == 0
    assert common_prefix([4], [1]) == 0


def test_layerskip_full_depth_equals_model(tiny):
    """LayerSkipModel with every layer is the model itself (same embedding, norm, head)."""
    x = mx.array([PROMPT], dtype=mx.uint32)
    np.testing.assert_allclose(np.array(LayerSkipModel(tiny.model, tiny.num_layers)(x)),
                               np.array(tiny.model(x)), rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
    with pytest.raises(ValueError):
        LayerSkipModel(tiny.model, 0)


def test_only_the_models_own_forward_is_the_flat_batchs_to_run(tiny):
    """`pipelines`: a verifier that overrides `forward` (a sharded one) decodes on its own
    forward in the serving engine; the plain one may be run in the flat batch."""

    class Own(Verifier):
        def forward(self, tokens):
            return super().forward(tokens)

    assert Verifier(tiny.model).pipelines and not Own(tiny.model).pipelines
