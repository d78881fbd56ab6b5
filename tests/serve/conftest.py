"""Fixtures for the serving tests: one `macfleet serve` (tiny model) per module, and one of the
embedded smollm2 per test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_testkit import Server, start_server, start_smollm2, stop_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--max-sessions-per-client", "6", "--max-body-bytes", "20000",
                     "--max-tokens-cap", "200", "--max-prompt-tokens", "600")
    try:
        yield s
    finally:
        stop_server(s)


@pytest.fixture(scope="session")
def smollm2_server() -> Iterator[Server]:
    """`serve --local` of the embedded smollm2 with the Hermes tools template and an API key
    (serve_testkit.start_smollm2): one per test process (an xdist worker starts it at most once,
    for the first module that asks), shared by every module that needs an ordinary one -- its
    load was 16 s of each such module's set-up. A test that needs other options or a fresh
    server's state starts its own."""
    from macfleet.engine.models import embedded_model_path

    if embedded_model_path() is None:
        pytest.skip("the embedded smollm2 is not installed")
    s = start_smollm2()
    try:
        yield s
    finally:
        stop_server(s)
