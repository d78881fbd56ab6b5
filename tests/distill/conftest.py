"""Fixtures for the data-factory tests: a tiny verifier and its features (helpers:
tests/eagle_fixtures.py, shared with tests/engine/proposers/eagle)."""

from __future__ import annotations

import pytest
from eagle_fixtures import SPEC, _greedy_text

from macfleet.engine.models import load_model
from macfleet.engine.proposers.eagle.features import extract_features


@pytest.fixture(scope="session")
def tiny():
    return load_model(SPEC)


@pytest.fixture(scope="session")
def chunks(tiny):
    return extract_features(tiny.model, _greedy_text(tiny, 40, 120), chunk=128)
