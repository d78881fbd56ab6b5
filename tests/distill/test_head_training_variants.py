"""Training variants of the draft head: the soft token target (the verifier's whole next-token
distribution, read off the stored features) and a head deepened by identity layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from macfleet.distill.heads import deepened, save_head
from macfleet.engine.proposers.eagle.head import load_head
from macfleet.distill.train import (TrainParams, _step_losses, chain_acceptance, loss_fn,
                                    train, untrained_loss)

from eagle_fixtures import _head  # noqa: E402  (fixtures: conftest.py)


@pytest.mark.slow
def test_soft_target_is_the_cross_entropy_to_the_verifiers_distribution(tiny, chunks):
    head = _head(tiny, chunks)
    c = chunks[0]
    feats = mx.array(c.hidden[None, :20].astype(np.float32))
    top = mx.array(c.top[None, :20])
    h = mx.random.normal(feats.shape) * float(mx.abs(feats).mean())
    _, soft = _step_losses(head, h, feats, top, 1.0, target="soft")
    p = mx.softmax(head.logits(feats), axis=-1)
    q = nn.log_softmax(head.logits(h), axis=-1)
    want = float(-(p * q).sum(-1).mean())
    assert abs(float(soft) - want) < 1e-4 * max(1.0, abs(want))
    # the head's own prediction of the target features: the cross-entropy is the target's
    # entropy, which is below the hard loss's minimum of a wrong guess
    _, self_ce = _step_losses(head, feats, feats, top, 1.0, target="soft")
    ent = float(-(p * mx.log(p + 1e-30)).sum(-1).mean())
    assert abs(float(self_ce) - ent) < 1e-3 * max(1.0, ent)
    assert float(self_ce) < float(soft)


@pytest.mark.slow
def test_soft_target_ignores_padding(tiny, chunks):
    head = _head(tiny, chunks)
    c = chunks[0]
    feats = mx.array(c.hidden[None, :16].astype(np.float32))
    top = mx.array(c.top[None, :16])
    h = mx.random.normal(feats.shape)
    _, a = _step_losses(head, h[:, :8], feats[:, :8], top[:, :8], 1.0, target="soft")
    padded_top = mx.concatenate([top[:, :8], mx.full((1, 8), -1, dtype=top.dtype)], axis=1)
    _, b = _step_losses(head, h, feats, padded_top, 1.0, target="soft")
    assert abs(float(a) - float(b)) < 1e-5 * max(1.0, abs(float(a)))


def test_unknown_target_is_refused(tiny, chunks):
    with pytest.raises(ValueError, match="target"):
        train(_head(tiny, chunks), chunks, TrainParams(steps=1, batch=1, seq_len=16,
                                                       target="medium"))


@pytest.mark.slow  # trains
def test_soft_training_lowers_its_loss(tiny, chunks):
    head = _head(tiny, chunks)
    p = TrainParams(steps=40, batch=8, seq_len=64, lr=3e-3, target="soft", reg_weight=0.5,
                    unroll_steps=2, save_every=10_000)
    before = untrained_loss(head, chunks[:-6], p)
    train(head, chunks[:-6], p)
    assert untrained_loss(head, chunks[:-6], p) < 0.8 * before


@pytest.mark.slow  # trains
def test_deepened_head_drafts_what_it_did_then_trains_and_round_trips(tiny, chunks, tmp_path):
    mx.random.seed(3)
    head = _head(tiny, chunks)
    deep = deepened(head, 2)
    assert len(deep.layers) == 2 and deep.config.layers == 2
    feats = mx.array(chunks[1].hidden[None, :24].astype(np.float32))
    toks = mx.array(chunks[1].tokens[None, 1:25].astype(np.uint32))
    assert np.array_equal(np.array(head(feats, toks)), np.array(deep(feats, toks)))
    a = chain_acceptance(head, chunks[-6:], max_starts=40)
    b = chain_acceptance(deep, chunks[-6:], max_starts=40)
    assert a == b
    with pytest.raises(ValueError, match="shrink"):
        deepened(deep, 1)
    p = TrainParams(steps=20, batch=4, seq_len=32, lr=3e-3, save_every=10_000)
    train(deep, chunks[:-6], p)
    moved = np.abs(np.array(deep.layers[1].self_attn.o_proj.weight)).max()
    assert moved > 0  # the added layer learns (its zero output projection moved)
    save_head(deep, tmp_path / "deep", steps=20)
    back = load_head(tmp_path / "deep", tiny.model)
    assert back.config.layers == 2
    out_a, out_b = deep(feats, toks), back(feats, toks)
    assert np.allclose(np.array(out_a), np.array(out_b),
                       atol=0.05 * float(mx.abs(out_a).max()))
    loss, _ = loss_fn(back, feats, mx.array(chunks[1].tokens[None, :24]),
                      mx.array(chunks[1].top[None, :24]), 1.0, 0.5, 0.0, target="soft")
    assert np.isfinite(float(loss))


def test_horizon_fits_the_steps_a_time_limit_allows():
    from macfleet.distill.train import Horizon, lr_at

    h = Horizon(1000)
    assert h.fit(step=10, seconds_per_step=0.5, seconds_left=100.0, most=1000) == 210
    assert h.fit(step=10, seconds_per_step=0.01, seconds_left=100.0, most=1000) == 1000
    assert h.fit(step=10, seconds_per_step=0.5, seconds_left=-3.0, most=1000) == 11
    p = TrainParams(lr=1e-3)
    assert lr_at(p, 0, 200) == pytest.approx(5e-5)
    assert lr_at(p, 20, 200) == pytest.approx(1e-3)
    assert lr_at(p, 200, 200) == pytest.approx(5e-5)
    assert lr_at(p, 110, 200) == pytest.approx(5e-5 + (1e-3 - 5e-5) * 0.5)


@pytest.mark.slow  # trains
def test_time_limit_ends_training_with_the_schedule_decayed(tiny, chunks):
    head = _head(tiny, chunks)
    seen = []
    losses = train(head, chunks[:-6], TrainParams(steps=100_000, batch=2, seq_len=16,
                                                  time_limit=1.5, save_every=100_000),
                   on_checkpoint=seen.append)
    assert 15 < len(losses) < 100_000 and seen == [len(losses)]


@pytest.mark.slow  # generates answers to 16 prompts
def test_compare_heads_scores_heads_on_the_same_unseen_answers(tiny, chunks, tmp_path):
    from macfleet.bench.drafter import compare_heads, prompts_json
    from macfleet.distill.prompts import HELD_OUT, UNSEEN

    head = _head(tiny, chunks)
    save_head(head, tmp_path / "a", steps=3)
    save_head(deepened(head, 2), tmp_path / "b", steps=3)  # drafts exactly what `a` drafts
    doc = compare_heads(tiny, [tmp_path / "a", tmp_path / "b"], max_answer=12)
    assert doc["prompts"] == prompts_json({**HELD_OUT, **UNSEEN})
    a, b = (doc["heads"][str(tmp_path / n)] for n in ("a", "b"))
    assert (a["layers"], b["layers"]) == (1, 2)
    for group in ("chat", "code", "all"):
        assert a[group] == b[group] and a[group]["starts"] > 0
        pp = a[group]["per_position"]
        assert all(x >= y for x, y in zip(pp, pp[1:]))  # a chain: each needs the one before
    assert a["chat"]["starts"] + a["code"]["starts"] == a["all"]["starts"]
    top = [a["first_draft_topk"][k] for k in ("1", "2", "4", "8")]
    assert top == sorted(top) and 0 <= top[0] and top[-1] <= 1


def test_unseen_prompts_are_never_training_prompts():
    """The unseen prompts are among the held-out keys, which the training prompts never are
    (test_dataset.py::test_prompts_are_varied_deduplicated_and_never_the_held_out_ones checks
    that on the same prompt stream; test_contamination.py, near-copies over every template)."""
    from macfleet.distill.prompts import HELD_OUT_KEYS, UNSEEN, Prompt

    assert {Prompt("x", t).key for t in UNSEEN.values()} <= HELD_OUT_KEYS
