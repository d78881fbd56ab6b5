"""The fleet key on disk (the one place it is written, read and looked for), and where the local
fleet's run files live.

MACFLEET_HOME (default ~/.macfleet) holds `fleet.key` (mode 0600) and `run/` (pids and logs of
agents started by `macfleet up`). MACFLEET_KEY overrides the key path. What the key is used for
(CURVE keypairs, the public fleet id) is bridge/auth.py's.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from bridge.auth import KEY_BYTES

log = logging.getLogger(__name__)


def keygen(path: str | os.PathLike[str], *, overwrite: bool = False) -> bytes:
    """Write a new random fleet key (hex) to `path` with mode 0600 and return it.

    Refuses to replace an existing key unless overwrite=True: replacing it locks this Mac out of
    its fleet.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(KEY_BYTES)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    fd = os.open(p, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by umask and ignored for existing files
        os.write(fd, key.hex().encode() + b"\n")
    finally:
        os.close(fd)
    return key


def load_key(path: str | os.PathLike[str]) -> bytes:
    """Read a key written by keygen; ValueError when the file does not hold one."""
    p = Path(path)
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("fleet key %s is readable by others (mode %o); chmod 600 it", p, mode & 0o777)
    text = p.read_text(encoding="ascii").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{p} does not hold a hex fleet key") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"{p}: fleet key must be {KEY_BYTES} bytes, got {len(key)}")
    return key


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
