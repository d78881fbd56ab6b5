"""The int8 F3 codec: half the bytes, bounded error, exact row maxima."""

from __future__ import annotations

import numpy as np

from macfleet.engine.proposers.eagle.f3codec import decode_int8, encode_int8


def test_int8_roundtrip_is_close_and_half_the_bytes():
    rng = np.random.default_rng(0)
    h = (rng.standard_normal((5, 576)) * 40).astype(np.float16)
    q, s = encode_int8(h)
    assert q.dtype == np.int8 and s.shape == (5,)
    assert q.nbytes + s.nbytes < 0.51 * h.nbytes
    back = decode_int8(q, s).astype(np.float32)
    err = np.abs(back - h.astype(np.float32)).max(axis=1)
    assert np.all(err <= np.abs(h.astype(np.float32)).max(axis=1) / 127 * 0.51 + 0.05)
    assert np.allclose(np.abs(back).max(axis=1), np.abs(h.astype(np.float32)).max(axis=1),
                       rtol=2e-3)


def test_zero_rows():
    z = np.zeros((2, 8), dtype=np.float16)
    assert np.array_equal(decode_int8(*encode_int8(z)), z)
