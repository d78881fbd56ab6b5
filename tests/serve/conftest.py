"""Fixtures for the serving tests: one `macfleet serve` (tiny model) per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_testkit import Server, start_server, stop_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--max-sessions-per-client", "6", "--max-body-bytes", "20000",
                     "--max-tokens-cap", "200", "--max-prompt-tokens", "600")
    try:
        yield s
    finally:
        stop_server(s)
