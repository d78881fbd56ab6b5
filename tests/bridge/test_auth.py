"""The fleet id (key files: tests/fleet/test_keys.py; CURVE keys derived from the key:
test_curve.py)."""

from __future__ import annotations

import pytest

from bridge import auth

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
OTHER = bytes(32)


def test_fleet_id_is_public_and_stable():
    fid = auth.fleet_id(KEY)
    assert fid == auth.fleet_id(KEY) != auth.fleet_id(OTHER)
    assert len(fid) == 16 and int(fid, 16) >= 0
    assert fid not in KEY.hex()
    assert auth.fleet_id(None) == auth.OPEN_FLEET_ID
