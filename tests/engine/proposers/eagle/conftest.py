"""Shared fixtures for the EAGLE tests: a tiny verifier, its features, a trained head
(helpers: tests/eagle_fixtures.py, shared with tests/distill)."""

from __future__ import annotations

import pytest
from eagle_fixtures import _head, chunks, tiny  # noqa: F401  (fixtures)

from macfleet.distill.train import TrainParams, train


@pytest.fixture(scope="session")
def trained(tiny, chunks):
    head = _head(tiny, chunks)
    # 100 steps: loss 0.67 (untrained 2.2), held-out chains 0.19 accepted (untrained 0.10),
    # the same as 200 steps gave (0.64, 0.18) in half the time
    train(head, chunks[:-6], TrainParams(steps=100, batch=8, seq_len=64, lr=3e-3,
                                         save_every=10_000))
    return head


def pytest_collection_modifyitems(config, items):
    """Tests that need the trained head train it first (tens of seconds): the slow lane."""
    for item in items:
        if "trained" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
