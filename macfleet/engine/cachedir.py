"""Where macfleet keeps what it measured or built on this machine (`MACFLEET_CACHE`, else
~/.cache/macfleet): verify(L) tables, answer-store indexes, the drafter measured best here.
Everything there can be deleted. `machine_id` names the machine a measurement belongs to."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MACFLEET_CACHE", Path.home() / ".cache" / "macfleet"))


def machine_id(cores: int | None = None) -> str:
    """This machine as its measurements are keyed: OS, architecture, processor, cores."""
    return (f"{platform.system()}-{platform.machine()}-{platform.processor()}-"
            f"{cores or os.cpu_count() or 1}")
