"""Helpers behind the EAGLE fixtures of tests/engine/proposers/eagle and tests/distill (tests/ is
on sys.path: tests/conftest.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from macfleet.engine.models import load_model
from macfleet.engine.proposers.eagle.features import extract_features
from macfleet.engine.proposers.eagle.head import EagleConfig, EagleHead
from macfleet.distill.train import feature_rms

SPEC = "tiny:1:16"


def _greedy_text(lm, n_seqs: int, length: int, seed: int = 0) -> list[tuple[list[int], bool]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_seqs):
        ids = rng.integers(0, lm.vocab_size, 8).tolist()
        gen = [int(t) for t, _ in generate_step(mx.array(ids, dtype=mx.uint32), lm.model,
                                                 max_tokens=length)]
        out.append((ids + gen, True))
    return out


def _head(lm, chunks, seed: int = 0) -> EagleHead:
    mx.random.seed(seed)
    cfg = EagleConfig.for_verifier(lm.model, lm.spec, feature_scale=feature_rms(chunks))
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
