"""The EAGLE draft head: training, persistence, verifier check, and lossless use in the loop.

Token ids: the "greedy margin" rule of tests/tolerance.py (blocks vs mlx-lm's plain
decoding).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macfleet.distill.heads import extract_features, save_head
from macfleet.engine.proposers.eagle.head import EagleConfig, EagleHead, HeadMismatch, load_head
from macfleet.engine.proposers.eagle.chain import EagleProposer
from macfleet.engine.proposers.shipped import default_head_path
from macfleet.distill.train import (TrainParams, chain_acceptance, feature_rms, train,
                                    untrained_loss)
from macfleet.engine.events import Finished
from reference_loops import speculative_generate
from macfleet.engine.models import load_model
from macfleet.engine.proposers.factory import ProposerSpecError, make_proposer
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.verifier import Verifier

from eagle_fixtures import SPEC, _head  # noqa: E402  (fixtures: conftest.py)


def test_training_lowers_loss_and_raises_held_out_acceptance(tiny, chunks, trained):
    p = TrainParams(batch=8, seq_len=64)
    fresh = _head(tiny, chunks)
    assert untrained_loss(trained, chunks[:-6], p) < 0.5 * untrained_loss(fresh, chunks[:-6], p)
    before = chain_acceptance(fresh, chunks[-6:], max_starts=150)
    after = chain_acceptance(trained, chunks[-6:], max_starts=150)
    assert after.starts == before.starts > 50
    assert after.mean_accepted > before.mean_accepted + 0.02


@pytest.mark.slow  # extracts features from generated text (the chunks fixture), then trains
def test_checkpoint_resume_continues_from_saved_step(tiny, chunks, tmp_path):
    head = _head(tiny, chunks)
    p = TrainParams(steps=6, batch=2, seq_len=32, save_every=3)
    train(head, chunks, p, ckpt=tmp_path / "ck")
    again = _head(tiny, chunks, seed=1)
    losses = train(again, chunks, TrainParams(steps=8, batch=2, seq_len=32, save_every=3),
                   ckpt=tmp_path / "ck", resume=True)
    assert len(losses) == 2  # resumed at step 6


def test_weights_round_trip(tiny, trained, tmp_path):
    path = save_head(trained, tmp_path / "head", steps=7)
    assert path.suffix == ".safetensors" and path.with_suffix(".json").is_file()
    back = load_head(tmp_path / "head", tiny.model)
    assert back.config.steps == 7 and back.config.fingerprint == trained.config.fingerprint
    feats = mx.random.normal((1, 5, tiny.hidden_size))
    toks = mx.array([[1, 2, 3, 4, 5]], dtype=mx.uint32)
    a, b = trained(feats, toks), back(feats, toks)
    assert np.allclose(np.array(a), np.array(b), atol=0.05 * float(mx.abs(a).max()))


def test_draft_vocabulary_subset_round_trips_and_stays_lossless(tiny, chunks, trained,
                                                                 tmp_path):
    from macfleet.distill.train import choose_draft_vocab

    ids = choose_draft_vocab(chunks, 10, tiny.vocab_size)
    assert len(ids) == 10 and len(set(ids.tolist())) == 10
    trained.set_draft_vocab(ids)
    try:
        save_head(trained, tmp_path / "sub")
    finally:
        trained.set_draft_vocab(None)
    back = load_head(tmp_path / "sub", tiny.model)
    assert back.config.draft_vocab == 10 and np.array(back.draft_ids).tolist() == ids.tolist()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    prop = EagleProposer(back)
    prop.start(SamplingParams())
    d = prop.propose(prompt, 4)
    prop.close()
    assert set(d.tokens) <= set(ids.tolist())
    assert _run(tiny, EagleProposer(back), prompt, 30).token_ids == \
        _run(tiny, None, prompt, 30).token_ids
    prop.start(SamplingParams(temperature=1.0, seed=2))
    d = prop.propose(prompt, 3)
    assert d.probs.shape == (3, tiny.vocab_size) and np.allclose(d.probs.sum(1), 1.0)
    outside = np.setdiff1d(np.arange(tiny.vocab_size), ids)
    assert np.all(d.probs[:, outside] == 0)


def test_draft_vocabulary_is_most_frequent_first_and_a_prefix_drafts_alone(tiny, chunks,
                                                                            trained, tmp_path):
    """choose_draft_vocab orders ids by count, so a prefix is the best smaller draft
    vocabulary; draft_logits(h, limit) on such a head is the full one's first columns, and the
    order survives a save; a head saved with ids in another order ignores the limit."""
    import json

    from macfleet.distill.train import choose_draft_vocab, frequency_order

    counts = np.bincount(np.concatenate([np.concatenate([c.tokens, c.top]) for c in chunks]),
                         minlength=tiny.vocab_size)
    ids = choose_draft_vocab(chunks, 12, tiny.vocab_size)
    assert np.all(np.diff(counts[ids]) <= 0)
    assert counts[ids].min() >= np.delete(counts, ids).max()
    h = mx.random.normal((3, tiny.hidden_size))
    trained.set_draft_vocab(ids, "frequency")
    try:
        full, pre = np.array(trained.draft_logits(h)), np.array(trained.draft_logits(h, 5))
        save_head(trained, tmp_path / "freq")
    finally:
        trained.set_draft_vocab(None)
    assert pre.shape == (3, 5) and np.allclose(pre, full[:, :5], rtol=1e-5, atol=1e-5)
    back = load_head(tmp_path / "freq", tiny.model)
    assert back.config.draft_order == "frequency"
    assert np.array(back.draft_ids).tolist() == ids.tolist()
    back.set_draft_vocab(np.sort(ids))  # ascending ids: no prefix is a frequent subset
    assert back.draft_logits(h, 5).shape == (3, 12)
    with pytest.raises(ValueError, match="draft_order"):
        back.set_draft_vocab(ids, "alphabetical")
    cfg = tmp_path / "freq.json"
    d = json.loads(cfg.read_text())
    del d["draft_order"]  # a head saved before the order was kept: ids ascending
    cfg.write_text(json.dumps(d))
    assert load_head(tmp_path / "freq", tiny.model).config.draft_order == "id"
    cfg.write_text(json.dumps({**d, "draft_order": "sideways"}))
    with pytest.raises(HeadMismatch, match="draft_order"):
        load_head(tmp_path / "freq", tiny.model)
    # re-ordering an existing vocabulary keeps its ids (ties: lower id first)
    again = frequency_order(np.array([0, 5, 5, 9, 0, 1]), 4, among=np.array([4, 2, 1, 3]))
    assert again.tolist() == [3, 1, 2, 4]


def test_head_for_another_verifier_is_refused(trained, tmp_path):
    save_head(trained, tmp_path / "head")
    other = load_model("tiny:2:16")
    with pytest.raises(HeadMismatch, match="trained for verifier 'tiny:1:16'.*macfleet distill"):
        load_head(tmp_path / "head", other.model)
    with pytest.raises(ProposerSpecError, match="eagle: .*fingerprint"):
        make_proposer(f"eagle:{tmp_path / 'head'}", other)


def _run(lm, proposer, prompt, n, params=SamplingParams()):
    evs = list(speculative_generate(Verifier(lm.model), proposer, prompt, params=params,
                                    max_tokens=n, eos_ids=lm.eos_ids))
    return evs[-1]


def test_greedy_loop_is_bit_identical_and_uses_the_verifier_features(tiny, trained):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    alone = _run(tiny, None, prompt, 40)
    prop = EagleProposer(trained)
    fin = _run(tiny, prop, prompt, 40)
    assert isinstance(fin, Finished) and fin.token_ids == alone.token_ids
    assert fin.stats.drafted > 0
    assert prop.fallback_tokens == 0  # every feature came from the verifier's own forwards
    # without the tap the proposer computes features itself: same drafts, same output
    own = EagleProposer(trained)
    own.untap()
    assert _run(tiny, own, prompt, 40).token_ids == alone.token_ids
    assert own.fallback_tokens > 0


def test_sampling_drafts_carry_probabilities(tiny, trained):
    prop = EagleProposer(trained)
    prop.start(SamplingParams(temperature=0.8, top_p=0.9, seed=1))
    d = prop.propose([3, 1, 4, 1, 5, 9], 4)
    prop.close()
    assert len(d) == 4 and d.probs.shape == (4, tiny.vocab_size)
    assert np.allclose(d.probs.sum(1), 1.0)
    assert all(d.probs[i, t] > 0 for i, t in enumerate(d.tokens))
    fin = _run(tiny, EagleProposer(trained), [3, 1, 4, 1], 20,
               SamplingParams(temperature=0.8, seed=3))
    assert fin.stats.tokens == 20


def test_eagle_spec_without_shipped_head_says_how_to_train(tiny):
    with pytest.raises(ProposerSpecError, match="macfleet distill"):
        make_proposer("eagle", tiny)


@pytest.mark.slow
def test_shipped_head_on_smollm2_is_bit_identical():
    if default_head_path("smollm2") is None or not default_head_path("smollm2").is_file():
        pytest.skip("no shipped head")
    try:
        lm = load_model("smollm2")
    except Exception as e:  # the embedded model is an optional install
        pytest.skip(f"embedded model unavailable: {e}")
    from macfleet.engine.text import encode_prompt

    prompt = encode_prompt(lm.tokenizer, "What is a hash table?", chat=True)
    alone = _run(lm, None, prompt, 24)
    fin = _run(lm, make_proposer("eagle", lm), prompt, 24)
    assert fin.token_ids == alone.token_ids
    assert fin.stats.accepted > 0
