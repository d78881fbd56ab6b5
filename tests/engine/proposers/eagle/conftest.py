"""Shared fixtures for the EAGLE tests: a tiny verifier, its features, a trained head
(helpers: tests/eagle_fixtures.py, shared with tests/distill)."""

from __future__ import annotations

import pytest
from eagle_fixtures import _head, chunks, tiny  # noqa: F401  (fixtures)

from macfleet.distill.train import TrainParams, train


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
