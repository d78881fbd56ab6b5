"""Many sessions' draft-model chains drafted together (`draft_model_chains`): one flat forward
per draft position over every session, each session's draft-model cache a row of one
`BatchKV` (`ModelProposer.share_rows`).

The chains must be the ones each proposer drafts alone (the batched attention only sums in
another order: logits within float tolerance, a different draft only at a near-tie, which a
random tiny model does not make), a row must roll back to the committed context as the
proposer's own cache does, and a batching engine drafting this way still answers every request
exactly as the verifier alone."""

from __future__ import annotations

import numpy as np
import pytest

from engine_testkit import drafting_contexts, engine_drafts_together_as_alone
from macfleet.engine.models import load_model
from macfleet.engine.proposers.base import EMPTY_DRAFT, draft_together
from macfleet.engine.proposers.factory import make_proposer
from macfleet.engine.proposers.model_draft import ModelProposer, draft_model_chains
from macfleet.engine.sampling import GREEDY, SamplingParams

DRAFT = "tiny:5:64"  # another random model: the verifier (tiny:1:64) rejects some drafts


@pytest.fixture(scope="module")
def draft():
    return load_model(DRAFT)


def _alone(model, ctxs, ks, params=GREEDY):
    out = []
    for c, k in zip(ctxs, ks):
        p = ModelProposer(model, "d")
        p.start(params)
        out.append(p.propose(c, k))
        p.close()
    return out


def _together(model, n, params=GREEDY):
    stores: dict = {}
    props = []
    for _ in range(n):
        p = ModelProposer(model, "d")
        p.start(params)
        p.share_rows(stores)
        props.append(p)
    assert len(stores) == 1  # one store for the one model
    return props, next(iter(stores.values()))


def test_chains_drafted_together_are_the_chains_drafted_alone(draft):
    ctxs, ks = drafting_contexts(draft.vocab_size), [3, 1, 4, 2]
    props, store = _together(draft.model, len(ctxs))
    got = draft_together(list(zip(props, ctxs, ks)))
    ref = _alone(draft.model, ctxs, ks)
    assert [d.tokens for d in got] == [d.tokens for d in ref]
    assert [len(d) for d in got] == ks
    # the next round: each context grew (a block accepted part of its draft, or none) and one
    # was cut back (another branch): every row rolls back to what it shares, as alone
    rng = np.random.default_rng(9)
    ctxs = [c + list(d.tokens[:1]) + rng.integers(0, draft.vocab_size, 2).tolist()
            for c, d in zip(ctxs, got)]
    ctxs[2] = ctxs[2][:7]
    got = draft_together(list(zip(props, ctxs, ks)))
    ref = _alone(draft.model, ctxs, ks)
    assert [d.tokens for d in got] == [d.tokens for d in ref]
    # a row holds the context and the drafts but the last (never fed): as the own cache does
    assert [p.rows is store for p in props] == [True] * len(props)
    assert [p._cache[0].offset for p in props] == [len(c) + k - 1 for c, k in zip(ctxs, ks)]
    # one proposer drafting alone in row mode goes the same way
    assert props[0].propose(ctxs[0], 3).tokens == ref[0].tokens
    for p in props:
        p.close()
    assert store.open_rows == 0  # closed proposers gave their rows back


def test_sampled_chains_together_carry_their_distributions(draft):
    ctxs, ks = drafting_contexts(draft.vocab_size), [2, 3, 1, 2]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    props, _ = _together(draft.model, len(ctxs), params)
    got = draft_together(list(zip(props, ctxs, ks)))
    ref = _alone(draft.model, ctxs, ks, params)
    assert [d.tokens for d in got] == [d.tokens for d in ref]  # same draws from each rng
    for d, r in zip(got, ref):
        assert d.probs.shape == (len(d), draft.vocab_size)
        # the rows' attention runs in one batched call (on the CPU with engine/fastmath's
        # softmax), a proposer alone in MLX's fused kernel: probabilities move in the last bits
        np.testing.assert_allclose(d.probs, r.probs, atol=1e-4)
        assert all(d.probs[i, t] > 0 for i, t in enumerate(d.tokens))


def test_rows_of_another_store_are_refused_and_a_model_the_flat_batch_cannot_run_drafts_alone(
        draft, tiny):
    a, _ = _together(draft.model, 1)
    b, _ = _together(draft.model, 1)
    plain = ModelProposer(draft.model, "d")
    ctx = drafting_contexts(draft.vocab_size)[0]
    with pytest.raises(ValueError, match="one store"):
        draft_model_chains([(a[0], ctx, 2), (b[0], ctx, 2)])
    with pytest.raises(ValueError, match="one store"):
        draft_model_chains([(a[0], ctx, 2), (plain, ctx, 2)])
    assert draft_model_chains([(a[0], ctx, 0), (a[0], [], 2)]) == [EMPTY_DRAFT, EMPTY_DRAFT]
    # layer-skip drafting wraps the verifier's first layers: not a model the flat forward
    # runs, so it keeps its own caches and drafts alone
    skip = make_proposer("layerskip:2", tiny)
    skip.start(GREEDY)
    stores: dict = {}
    skip.share_rows(stores)
    assert skip.rows is None and not stores
    assert len(skip.propose(ctx, 3)) == 3


@pytest.mark.slow
def test_batching_engine_drafts_every_model_chain_together_and_answers_as_alone(tiny):
    done = engine_drafts_together_as_alone(tiny, f"draft:{DRAFT}")
    assert sum(f.stats.accepted for f in done.values()) < sum(
        f.stats.drafted for f in done.values())  # some drafts rejected: rows rolled back
