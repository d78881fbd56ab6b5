"""The fleet key file: written private, read back, never overwritten by accident; and the
one place commands look it up (resolve_key)."""

from __future__ import annotations

import os
import stat

import pytest

from macfleet.fleet import keys

pytestmark = pytest.mark.timeout(30)


def test_keygen_writes_private_hex_key(tmp_path):
    path = tmp_path / "fleet" / "key"
    key = keys.keygen(path)
    assert len(key) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text().strip() == key.hex()
    assert keys.load_key(path) == key


def test_keygen_refuses_to_overwrite(tmp_path):
    path = tmp_path / "key"
    key = keys.keygen(path)
    with pytest.raises(FileExistsError):
        keys.keygen(path)
    assert keys.load_key(path) == key
    assert keys.keygen(path, overwrite=True) != key


def test_load_key_refuses_garbage(tmp_path):
    path = tmp_path / "key"
    path.write_text("not hex")
    path.chmod(0o600)
    with pytest.raises(ValueError):
        keys.load_key(path)
    path.write_text("ab" * 16)
    with pytest.raises(ValueError):
        keys.load_key(path)


def test_resolve_key_finds_creates_or_names_the_missing_key(tmp_path, monkeypatch):
    monkeypatch.setenv("MACFLEET_HOME", str(tmp_path))
    assert keys.resolve_key(open_fleet=True) is None
    with pytest.raises(keys.KeyMissing, match="macfleet keygen"):
        keys.resolve_key()
    made = keys.resolve_key(create=True)
    assert keys.resolve_key() == made == keys.load_key(tmp_path / "fleet.key")


def test_load_key_refuses_a_world_readable_key_with_the_fix(tmp_path):
    path = tmp_path / "fleet.key"
    key = keys.keygen(path)
    path.chmod(0o644)
    with pytest.raises(keys.KeyUnsafe, match="chmod 600"):
        keys.load_key(path)
    path.chmod(0o602)  # writable by all: anyone can swap the fleet under this Mac
    with pytest.raises(keys.KeyUnsafe):
        keys.load_key(path)
    path.chmod(0o640)  # the group only: a warning, still used
    assert keys.load_key(path) == key


def test_a_key_line_round_trips_and_shows_no_more_than_the_key():
    key = bytes(range(32))
    line = keys.export_line(key)
    assert line.startswith("macfleet-key-v1:") and "\n" not in line and " " not in line
    assert keys.parse_line(line) == key
    assert keys.parse_line(f"  {line[:30]}\n  {line[30:]}\n") == key  # wrapped by a terminal
    assert keys.parse_line(line.upper()) == key


@pytest.mark.parametrize("damage, why", [
    (lambda s: s[:-1], "truncated"),                       # last checksum digit lost
    (lambda s: s[:40], "truncated"),                       # half a paste
    (lambda s: s.replace(":", ":0", 1), "truncated"),      # an extra digit
    (lambda s: s[:20] + ("0" if s[20] != "0" else "1") + s[21:], "checksum"),  # one typo
    (lambda s: s[:20] + s[21] + s[20] + s[22:], "checksum"),  # two digits swapped
    (lambda s: s[:20] + "g" + s[21:], "other than hex"),
    (lambda s: s.replace("v1", "v2"), "not a fleet key line"),
    (lambda s: "", "not a fleet key line"),
    (lambda s: bytes(range(32)).hex(), "not a fleet key line"),  # the bare key file content
])
def test_a_damaged_key_line_is_refused(damage, why):
    line = keys.export_line(bytes(range(32)))
    bad = damage(line)
    assert bad != line
    with pytest.raises(ValueError, match=why):
        keys.parse_line(bad)


def test_write_key_is_private_atomic_and_never_replaces_another_key_unforced(tmp_path):
    path = tmp_path / "home" / "fleet.key"
    a, b = b"a" * 32, b"b" * 32
    assert keys.write_key(path, a) is True
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert keys.load_key(path) == a
    assert keys.write_key(path, a) is False  # the same key: nothing to do
    with pytest.raises(FileExistsError):
        keys.write_key(path, b)
    assert keys.load_key(path) == a
    assert keys.write_key(path, b, overwrite=True) is True
    assert keys.load_key(path) == b
    assert sorted(p.name for p in path.parent.iterdir()) == ["fleet.key"]  # no temp left
    path.write_text("garbage")  # an unreadable file is not replaced unforced either
    with pytest.raises(FileExistsError):
        keys.write_key(path, a)
