"""The fleet id (key files: tests/fleet/test_keys.py; CURVE keys derived from the key:
test_curve.py)."""

from __future__ import annotations

import hashlib

import pytest

from bridge import auth

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
OTHER = bytes(32)


def test_fleet_id_is_public_and_stable():
    fid = auth.fleet_id(KEY)
    assert fid == auth.fleet_id(KEY) != auth.fleet_id(OTHER)
    assert len(fid) == 16 and set(fid) <= set("0123456789abcdef")
    # a known answer: agents of different versions must keep finding each other, so the id
    # of a key never changes (sha256 of a domain tag and the key, first 16 hex digits)
    assert fid == "5ff2f917278e71b7" and auth.fleet_id(OTHER) == "c803d01b6b6888db"
    assert fid != hashlib.sha256(KEY).hexdigest()[:16]  # domain-separated, not the plain hash
    assert fid not in KEY.hex()
    assert auth.fleet_id(None) == auth.OPEN_FLEET_ID
