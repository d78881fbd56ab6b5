"""Many sessions' EAGLE chains drafted together (`draft_chains`): one head forward per draft
position over every session, each session's head cache a row of one `BatchKV`.

The chains must be the ones each proposer drafts alone (the batched attention only sums in
another order: logits within float tolerance, a different draft only at a near-tie, which a
random tiny head does not make), rollback of a row must follow the committed context as the
proposer's own cache does, and a batching engine drafting this way still answers every
request exactly as the verifier alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macfleet.distill.heads import config_for_verifier, init_from_verifier, save_head
from macfleet.engine.proposers.eagle.head import EagleHead
from macfleet.engine.proposers.eagle.chain import EagleProposer, draft_chains
from macfleet.engine.proposers.eagle.load import shared_head
from engine_testkit import drafting_contexts, engine_drafts_together_as_alone
from macfleet.engine.events import Finished
from reference_loops import speculative_generate
from macfleet.engine.proposers.base import EMPTY_DRAFT
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.verifier import Verifier
from macfleet.serve.engine import BatchEngine, EngineRequest
from macfleet.serve.session_kv import SessionKV


@pytest.fixture(scope="module")
def head(tiny):
    mx.random.seed(5)
    h = EagleHead(config_for_verifier(tiny.model, tiny.spec, feature_scale=1.0), tiny.model)
    init_from_verifier(h)
    h.set_draft_vocab(np.arange(0, tiny.vocab_size, 2))  # drafts map through the subset's ids
    mx.eval(h.parameters())
    return h


def _alone(head, ctxs, ks, params=GREEDY):
    out = []
    for c, k in zip(ctxs, ks):
        p = EagleProposer(head)
        p.untap()  # features computed by the proposer itself
        p.start(params)
        out.append(p.propose(c, k))
        p.close()
    return out


def _together(head, n, params=GREEDY):
    stores: dict = {}
    props = []
    for _ in range(n):
        p = EagleProposer(head)
        p.untap()
        p.start(params)
        p.share_rows(stores)
        props.append(p)
    return props, stores[id(head)]


def test_chains_drafted_together_are_the_chains_drafted_alone(tiny, head):
    ctxs, ks = drafting_contexts(tiny.vocab_size), [3, 1, 4, 2]
    props, store = _together(head, len(ctxs))
    got = draft_chains(list(zip(props, ctxs, ks)))
    ref = _alone(head, ctxs, ks)
    assert [d.tokens for d in got] == [d.tokens for d in ref]
    assert [len(d) for d in got] == ks
    assert all(t % 2 == 0 for d in got for t in d.tokens)  # from the draft vocabulary
    # the next round: each context grew (a block accepted part of its draft, or none) and one
    # was cut back (another branch): every row rolls back to its committed pairs, as alone
    rng = np.random.default_rng(9)
    ctxs = [c + list(d.tokens[:1]) + rng.integers(0, tiny.vocab_size, 2).tolist()
            for c, d in zip(ctxs, got)]
    ctxs[2] = ctxs[2][:7]
    got = draft_chains(list(zip(props, ctxs, ks)))
    ref = _alone(head, ctxs, ks)
    assert [d.tokens for d in got] == [d.tokens for d in ref]
    # a row holds the committed pairs only (drafted ones trimmed): len(context) - 1
    assert [p.rows is store for p in props] == [True] * len(props)
    assert [p._row.offset for p in props] == [len(c) - 1 for c in ctxs]
    # one proposer drafting alone in row mode goes the same way
    assert props[0].propose(ctxs[0], 3).tokens == ref[0].tokens
    for p in props:
        p.close()
    assert store.open_rows == 0  # closed proposers gave their rows back


def test_sampled_chains_together_carry_their_distributions(tiny, head):
    ctxs, ks = drafting_contexts(tiny.vocab_size), [2, 3, 1, 2]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    props, _ = _together(head, len(ctxs), params)
    got = draft_chains(list(zip(props, ctxs, ks)))
    ref = _alone(head, ctxs, ks, params)
    assert [d.tokens for d in got] == [d.tokens for d in ref]  # same draws from each rng
    for d, r in zip(got, ref):
        assert d.probs.shape == (len(d), tiny.vocab_size)
        # the rows' attention runs in one batched call (on the CPU with engine/fastmath's
        # softmax), a proposer alone in MLX's fused kernel: probabilities move by ~2e-5
        np.testing.assert_allclose(d.probs, r.probs, atol=1e-4)
        assert all(d.probs[i, t] > 0 for i, t in enumerate(d.tokens))


def test_rows_of_another_store_are_refused(tiny, head):
    a, _ = _together(head, 1)
    b, _ = _together(head, 1)
    plain = EagleProposer(head)
    ctx = drafting_contexts(tiny.vocab_size)[0]
    with pytest.raises(ValueError, match="one store"):
        draft_chains([(a[0], ctx, 2), (b[0], ctx, 2)])
    with pytest.raises(ValueError, match="one store"):
        draft_chains([(plain, ctx, 2)])
    # nothing to draft (k 0, or no pair yet): empty drafts, no forward
    assert draft_chains([(a[0], ctx, 0), (a[0], ctx[:1], 2)]) == [EMPTY_DRAFT, EMPTY_DRAFT]


def test_sessions_share_one_loaded_head(tiny, head, tmp_path):
    save_head(head, tmp_path / "h")
    one, two = shared_head(tmp_path / "h", tiny.model), shared_head(tmp_path / "h", tiny.model)
    assert one is two


@pytest.mark.slow
def test_batching_engine_drafts_every_eagle_chain_together_and_answers_as_alone(
        tiny, head, tmp_path):
    save_head(head, tmp_path / "h")
    engine_drafts_together_as_alone(tiny, f"eagle:{tmp_path / 'h'}")


def test_sessions_fed_hidden_states_share_a_prompt_prefix_with_its_rows(tiny, head, tmp_path,
                                                                        monkeypatch):
    """A chat template makes every prompt start alike: a session whose drafter reads hidden
    states copies the prefix from another's cache with that drafter's rows of it, and both
    answer as alone (the rows copied are the ones its own prefill would have fed)."""
    import macfleet.serve.engine as serve_engine

    save_head(head, tmp_path / "h")
    rng = np.random.default_rng(3)
    common = rng.integers(0, tiny.vocab_size, size=24).tolist()
    prompts = [tuple(common + rng.integers(0, tiny.vocab_size, size=n).tolist())
               for n in (3, 5, 8, 2)]
    copied = []
    real_copy, real_draft = serve_engine.copy_features, serve_engine.draft_together

    def spy(src, dst, n):
        ok = real_copy(src, dst, n)
        copied.append((n, ok, bool(dst.feeds)))
        return ok

    def serve(drafts: dict) -> dict[int, Finished]:
        def recording(jobs, *a, **kw):
            out = real_draft(jobs, *a, **kw)
            for (_, ctx, _), d in zip(jobs, out):
                drafts[tuple(ctx)] = d.tokens
            return out

        monkeypatch.setattr(serve_engine, "draft_together", recording)
        eng = BatchEngine(tiny, proposer=f"eagle:{tmp_path / 'h'}", draft_tokens=2,
                          max_active=8)
        done: dict[int, Finished] = {}
        for i, p in enumerate(prompts):
            eng.submit(EngineRequest(p, GREEDY, 10),
                       lambda ev, i=i: done.__setitem__(i, ev) if isinstance(ev, Finished)
                       else None)
        eng.run_until_idle()
        return done

    monkeypatch.setattr(serve_engine, "copy_features", spy)
    shared_drafts: dict = {}
    done = serve(shared_drafts)
    assert copied and all(ok and fed and n >= 24 for n, ok, fed in copied)
    for i, p in enumerate(prompts):
        alone = list(speculative_generate(Verifier(tiny.model), None, p, params=GREEDY,
                                          max_tokens=10, eos_ids=tiny.eos_ids))[-1]
        assert done[i].token_ids == alone.token_ids
    # the copied rows are the ones a prefill of its own gives: the same drafts
    monkeypatch.setattr(SessionKV, "share_prefixes", lambda self, batch, copy: batch)
    own_drafts: dict = {}
    serve(own_drafts)
    assert shared_drafts == own_drafts and len(own_drafts) >= len(prompts)
