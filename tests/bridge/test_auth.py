"""Fleet key files and the fleet id (CURVE keys derived from the key: test_curve.py)."""

from __future__ import annotations

import os
import stat

import pytest

from bridge import auth

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
OTHER = bytes(32)


def test_keygen_writes_private_hex_key(tmp_path):
    path = tmp_path / "fleet" / "key"
    key = auth.keygen(path)
    assert len(key) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text().strip() == key.hex()
    assert auth.load_key(path) == key


def test_keygen_refuses_to_overwrite(tmp_path):
    path = tmp_path / "key"
    key = auth.keygen(path)
    with pytest.raises(FileExistsError):
        auth.keygen(path)
    assert auth.load_key(path) == key
    assert auth.keygen(path, overwrite=True) != key


def test_load_key_refuses_garbage(tmp_path):
    path = tmp_path / "key"
    path.write_text("not hex")
    with pytest.raises(ValueError):
        auth.load_key(path)
    path.write_text("ab" * 16)
    with pytest.raises(ValueError):
        auth.load_key(path)


def test_fleet_id_is_public_and_stable():
    fid = auth.fleet_id(KEY)
    assert fid == auth.fleet_id(KEY) != auth.fleet_id(OTHER)
    assert len(fid) == 16 and int(fid, 16) >= 0
    assert fid not in KEY.hex()
    assert auth.fleet_id(None) == auth.OPEN_FLEET_ID
