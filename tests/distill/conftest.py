"""Fixtures for the data-factory tests: a tiny verifier and its features (one definition,
tests/eagle_fixtures.py, shared with tests/engine/proposers/eagle)."""

from __future__ import annotations

from eagle_fixtures import chunks, tiny  # noqa: F401  (fixtures)
