"""Fleet key files, fleet id, MAC sign/verify and the replay window."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest

from bridge import auth, codec
from bridge.errors import ProtocolError
from bridge.messages import HiddenStates, Ping

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))
OTHER = bytes(32)


def refused(frames, key=KEY, guard=None):
    with pytest.raises(ProtocolError) as info:
        auth.verify(frames, key, guard)
    assert info.value.code == "auth"
    return info.value


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


def signed(msg=None, key=KEY, **kw):
    return auth.sign(codec.encode(msg or Ping(1, 2), **kw), key)


def test_sign_verify_roundtrip_with_buffers():
    msg = HiddenStates("s", 3, [1, 2], np.arange(8, dtype=np.float16).reshape(2, 4))
    frames = signed(msg)
    assert len(frames) == 4 and len(frames[-1]) == auth.MAC_BYTES
    payload = auth.verify(frames, KEY, auth.ReplayGuard())
    assert len(payload) == 3
    assert np.array_equal(codec.decode(payload).msg.states, msg.states)


def test_wrong_key_missing_mac_and_tampering_are_refused():
    frames = signed()
    refused(frames, key=OTHER)
    refused(frames[:-1])  # no MAC: the body is taken as the MAC
    refused(frames[:1])
    refused([])
    refused(codec.encode(Ping(1, 2)))  # an open-fleet message to a closed fleet
    refused([*frames[:-1], frames[-1][:-1]])
    refused([frames[0], frames[1][:-1] + b"\x01", frames[2]])
    refused([*frames[:-1], "text"])


def test_moving_bytes_between_frames_is_refused():
    header, body, mac = signed()
    refused([header + body[:1], body[1:], mac])


def test_buffer_tampering_is_refused():
    frames = signed(HiddenStates("s", 0, [0], np.zeros((1, 4), np.float32)))
    buf = bytearray(frames[2])
    buf[0] ^= 1
    refused([frames[0], frames[1], bytes(buf), frames[3]])


def test_replay_and_staleness_are_refused():
    guard = auth.ReplayGuard(window_s=5)
    frames = signed()
    auth.verify(frames, KEY, guard)
    assert "replayed" in refused(frames, guard=guard).message
    refused(signed(t_ns=time.time_ns() - 10 * 10**9), guard=guard)
    refused(signed(t_ns=time.time_ns() + 10 * 10**9), guard=guard)
    auth.verify(signed(), KEY, guard)  # a fresh message still passes


def test_replay_guard_forgets_after_window():
    now = [10**12]
    guard = auth.ReplayGuard(window_s=1, clock=lambda: now[0])
    for i in range(100):
        guard.check(f"id{i}", now[0])
    assert len(guard) == 100
    now[0] += 3 * 10**9
    guard.check("fresh", now[0])
    assert len(guard) == 1
    with pytest.raises(ProtocolError):
        guard.check("id0", now[0] - 3 * 10**9)  # the old copy is now stale instead


def test_open_fleet_passes_through():
    frames = codec.encode(Ping(1, 2))
    assert auth.sign(frames, None) == frames
    assert auth.verify(frames, None) == frames
