"""Where the fleet key and the local fleet's run files live.

MACFLEET_HOME (default ~/.macfleet) holds `fleet.key` (mode 0600) and `run/` (pids and logs of
agents started by `macfleet up`). MACFLEET_KEY overrides the key path.
"""

from __future__ import annotations

import os
from pathlib import Path

from bridge.auth import keygen, load_key


def home() -> Path:
    return Path(os.environ.get("MACFLEET_HOME", Path.home() / ".macfleet")).expanduser()


def default_key_path() -> Path:
    return Path(os.environ.get("MACFLEET_KEY", home() / "fleet.key")).expanduser()


def run_dir() -> Path:
    return home() / "run"


class KeyMissing(FileNotFoundError):
    pass


def resolve_key(path: str | os.PathLike | None = None, *, open_fleet: bool = False,
                create: bool = False) -> bytes | None:
    """The fleet key (None only when an open fleet is explicitly asked for)."""
    if open_fleet:
        return None
    p = Path(path).expanduser() if path else default_key_path()
    if not p.exists():
        if not create:
            raise KeyMissing(f"no fleet key at {p}: run `macfleet keygen` (or copy the key of "
                             "your fleet there), or pass --open for an unauthenticated fleet")
        p.parent.mkdir(parents=True, exist_ok=True)
        return keygen(p)
    return load_key(p)
