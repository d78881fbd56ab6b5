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
