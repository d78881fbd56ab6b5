"""The fleet key on disk (the one place it is written, read and looked for), and where the local
fleet's run files live.

MACFLEET_HOME (default ~/.macfleet) holds `fleet.key` (mode 0600) and `run/` (pids and logs of
agents started by `macfleet up`). MACFLEET_KEY overrides the key path. What the key is used for
(CURVE keypairs, the public fleet id) is bridge/auth.py's.

A key travels between Macs as one line (`export_line` / `parse_line`): a version tag, the key in
hex and a checksum, so a typo or a truncated paste is refused instead of silently making a Mac
join a fleet of its own. A key file others can read is refused (KeyUnsafe), as ssh refuses an
unprotected private key: anyone holding the key can join the fleet and read its traffic.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
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


class KeyUnsafe(PermissionError):
    """The key file can be read or changed by every user of this machine."""


def check_private(path: Path) -> None:
    """KeyUnsafe when others (every user) may read or write the key file; a warning for group."""
    mode = path.stat().st_mode
    if mode & stat.S_IRWXO:
        raise KeyUnsafe(f"fleet key {path} is readable by every user of this machine (mode "
                        f"{mode & 0o777:o}); anyone holding it can join the fleet: run "
                        f"`chmod 600 {path}` (and replace the key with `macfleet keygen --force` "
                        "on every Mac if others may have read it)")
    if mode & stat.S_IRWXG:
        log.warning("fleet key %s is readable by its group (mode %o); chmod 600 it", path,
                    mode & 0o777)


def load_key(path: str | os.PathLike[str]) -> bytes:
    """Read a key written by keygen; ValueError when the file does not hold one, KeyUnsafe when
    every user of the machine may read it."""
    p = Path(path)
    check_private(p)
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
    """No key at the default path: this machine is in no fleet (commands that can run without
    one do)."""


class KeyPathMissing(FileNotFoundError):
    """The key file named explicitly does not exist: an error for every command (never "no
    fleet")."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"--key {path}: no such file (`macfleet keygen --key {path}` writes a "
                         f"new key there, `macfleet key import --key {path}` your fleet's)")
        self.path = path


def resolve_key(path: str | os.PathLike | None = None, *, open_fleet: bool = False,
                create: bool = False) -> bytes | None:
    """The fleet key (None only when an open fleet is explicitly asked for)."""
    if open_fleet:
        return None
    p = Path(path).expanduser() if path else default_key_path()
    if not p.exists():
        if path and not create:
            raise KeyPathMissing(p)
        if not create:
            raise KeyMissing(f"no fleet key at {p}: run `macfleet keygen` (or copy the key of "
                             "your fleet there), or pass --open for an unauthenticated fleet")
        p.parent.mkdir(parents=True, exist_ok=True)
        return keygen(p)
    return load_key(p)


LINE_TAG = "macfleet-key-v1"
_CHECKSUM_DOMAIN = b"macfleet-key-line-v1\0"
_HEX_RE = re.compile(r"^[0-9a-f]*$")


def _checksum(key: bytes) -> str:
    return hashlib.sha256(_CHECKSUM_DOMAIN + key).hexdigest()[:8]


def export_line(key: bytes) -> str:
    """The key as one copyable line: `macfleet-key-v1:<64 hex>:<8 hex checksum>`."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a fleet key is {KEY_BYTES} bytes, got {len(key)}")
    return f"{LINE_TAG}:{key.hex()}:{_checksum(key)}"


def parse_line(line: str) -> bytes:
    """The key of an `export_line`; ValueError that says what is wrong with a bad paste."""
    text = "".join(line.split()).lower()  # a line wrapped or indented by a terminal
    tag, _, rest = text.partition(":")
    if tag != LINE_TAG:
        raise ValueError(f"not a fleet key line (expected {LINE_TAG}:<64 hex digits>:<8 hex "
                         "digits>, as `macfleet key export` prints it)")
    hexkey, _, check = rest.partition(":")
    if not _HEX_RE.match(hexkey) or not _HEX_RE.match(check):
        raise ValueError("the key line holds characters other than hex digits after "
                         f"'{LINE_TAG}:'; copy it again from `macfleet key export`")
    if len(hexkey) != 2 * KEY_BYTES or len(check) != 8:
        raise ValueError(f"the key line is truncated or has extra characters ({len(hexkey)} of "
                         f"{2 * KEY_BYTES} key digits, {len(check)} of 8 checksum digits)")
    key = bytes.fromhex(hexkey)
    if _checksum(key) != check:
        raise ValueError("the key line's checksum does not match: a character was mistyped; "
                         "copy the line again from `macfleet key export`")
    return key


def write_key(path: str | os.PathLike[str], key: bytes, *, overwrite: bool = False) -> bool:
    """Write `key` to `path` (mode 0600, parent 0700, atomically); False when the file already
    holds this key. FileExistsError when it holds another (or something unreadable) and
    overwrite is False: replacing it moves this Mac to another fleet."""
    p = Path(path).expanduser()
    if p.exists():
        try:
            same = bytes.fromhex(p.read_text(encoding="ascii").strip()) == key
        except (ValueError, UnicodeDecodeError):
            same = False
        if same:
            os.chmod(p, 0o600)
            return False
        if not overwrite:
            raise FileExistsError(f"{p} holds another fleet key")
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, p)
    return True
