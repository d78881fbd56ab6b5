"""Where macfleet keeps what it measured or built on this machine (`MACFLEET_CACHE`, else
~/.cache/macfleet): verify(L) tables, answer-store indexes. Everything there can be deleted."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MACFLEET_CACHE", Path.home() / ".cache" / "macfleet"))
