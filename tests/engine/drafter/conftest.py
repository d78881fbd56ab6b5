"""Shared fixtures for the drafter tests: a tiny verifier, its features, a trained head."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from drafter_fixtures import SPEC, _greedy_text, _head  # noqa: E402

from macfleet.engine.drafter.features import extract_features  # noqa: E402
from macfleet.engine.drafter.train import TrainParams, train  # noqa: E402
from macfleet.engine.models import load_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    return load_model(SPEC)


@pytest.fixture(scope="session")
def chunks(tiny):
    return extract_features(tiny.model, _greedy_text(tiny, 40, 120), chunk=128)


@pytest.fixture(scope="session")
def trained(tiny, chunks):
    head = _head(tiny, chunks)
    train(head, chunks[:-6], TrainParams(steps=200, batch=8, seq_len=64, lr=3e-3,
                                         save_every=10_000))
    return head


def pytest_collection_modifyitems(config, items):
    """Tests that need the trained head train it first (tens of seconds): the slow lane."""
    for item in items:
        if "trained" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
