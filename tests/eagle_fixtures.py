"""Helpers behind the EAGLE fixtures of tests/engine/proposers/eagle and tests/distill (tests/ is
on sys.path: tests/conftest.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from macfleet.engine.models import load_model
from macfleet.distill.heads import config_for_verifier, extract_features
from macfleet.engine.proposers.eagle.head import EagleHead
from macfleet.distill.train import feature_rms

SPEC = "tiny:1:16"


def greedy_batch(lm, n_seqs: int, length: int, seed: int = 0, prompt_len: int = 8
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """`n_seqs` random `prompt_len`-token prompts and `length` greedy tokens of `lm` after each,
    decoded as one batch (the same ids as mlx-lm's generate_step one sequence at a time, checked
    when this replaced it: 40 x 120 tokens in 3 s instead of 15 s)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, lm.vocab_size, prompt_len).tolist() for _ in range(n_seqs)]
    cache = make_prompt_cache(lm.model)
    logits = lm.model(mx.array(prompts, dtype=mx.uint32), cache=cache)[:, -1]
    gen = []
    for _ in range(length):
        gen.append(mx.argmax(logits, axis=-1))
        logits = lm.model(gen[-1][:, None], cache=cache)[:, -1]
    return prompts, np.array(mx.stack(gen, axis=1)).tolist()


def _greedy_text(lm, n_seqs: int, length: int, seed: int = 0) -> list[tuple[list[int], bool]]:
    """`greedy_batch`'s prompts with their answers, as training text (the fast lane's slowest
    set-up before it was batched)."""
    prompts, rows = greedy_batch(lm, n_seqs, length, seed)
    return [(p + g, True) for p, g in zip(prompts, rows)]


def _head(lm, chunks, seed: int = 0) -> EagleHead:
    mx.random.seed(seed)
    cfg = config_for_verifier(lm.model, lm.spec, feature_scale=feature_rms(chunks))
    head = EagleHead(cfg, lm.model)
    mx.eval(head.parameters())
    return head


# the fixtures both folders use (their conftests import them: one definition)
@pytest.fixture(scope="session")
def tiny():
    return load_model(SPEC)


@pytest.fixture(scope="session")
def chunks(tiny):
    return extract_features(tiny.model, _greedy_text(tiny, 40, 120), chunk=128)
