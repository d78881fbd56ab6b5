"""Hypothesis fuzzing of decode: whatever the bytes, the only exception is ProtocolError.

Examples are small and the database is off, so the whole module runs in a few seconds.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge import codec
from bridge.card import PROTOCOL_VERSION
from bridge.errors import CODES, ProtocolError
from bridge.messages import equal, example, registry, schema

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # slow: 200-2,000 examples per test

FUZZ = settings(max_examples=2000, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_MID = settings(FUZZ, max_examples=500)
FUZZ_SMALL = settings(FUZZ, max_examples=200)

TAGS = sorted(registry())
VALID = [codec.encode(example(registry()[t], seed=s, dtype=d, none=n), msg_id=f"id{i}")
         for i, (t, s, d, n) in enumerate((t, s, d, n) for t in TAGS for s, d, n in
                                          ((0, "float32", False), (3, "bfloat16", True)))]


def decode_or_refuse(frames, **kw):
    """Decode must either succeed or raise ProtocolError with a known code."""
    try:
        env = codec.decode(frames, **kw)
    except ProtocolError as exc:
        assert exc.code in CODES
        return None
    # Anything accepted re-encodes to something that decodes to the same message.
    assert equal(codec.decode(codec.encode(env.msg)).msg, env.msg)
    return env


@FUZZ
@given(st.lists(st.binary(max_size=48), max_size=6))
def test_random_frames(frames):
    decode_or_refuse(frames)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@FUZZ_SMALL
@given(st.sampled_from(TAGS), st.dictionaries(st.text(max_size=10), msgpack_values, max_size=6),
       st.lists(st.binary(max_size=32), max_size=3))
def test_random_bodies_for_real_types(tag, fields, buffers):
    names = list(schema(registry()[tag]).names)
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": tag, "id": "x", "session": "",
                            "reply_to": None, "t_ns": 0})
    decode_or_refuse([header, msgpack.packb(fields), *buffers])
    # The same random values under the real field names get further into the validators.
    real = {n: fields.get(n, v) for n, v in zip(names, list(fields.values()) + [None] * len(names))}
    decode_or_refuse([header, msgpack.packb(real), *buffers])


@FUZZ_SMALL
@given(st.data())
def test_one_field_replaced(data):
    frames = data.draw(st.sampled_from(VALID))
    body = msgpack.unpackb(frames[1])
    if body:
        key = data.draw(st.sampled_from(sorted(body)))
        body[key] = data.draw(msgpack_values)
    decode_or_refuse([frames[0], msgpack.packb(body), *frames[2:]])


@st.composite
def mutated(draw):
    original = draw(st.sampled_from(VALID))
    frames = [bytes(f) for f in original]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "drop", "dup", "swap", "header"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if not frames:
            break
        f = frames[i]
        if op == "flip" and f:
            j = draw(st.integers(0, len(f) - 1))
            frames[i] = f[:j] + bytes([f[j] ^ draw(st.integers(1, 255))]) + f[j + 1:]
        elif op == "truncate":
            frames[i] = f[: draw(st.integers(0, len(f)))]
        elif op == "insert":
            j = draw(st.integers(0, len(f)))
            frames[i] = f[:j] + draw(st.binary(min_size=1, max_size=8)) + f[j:]
        elif op == "drop":
            frames.pop(i)
        elif op == "dup":
            frames.insert(i, f)
        elif op == "swap" and len(frames) > 1:
            frames[0], frames[i] = frames[i], frames[0]
        elif op == "header":
            h = msgpack.unpackb(original[0])
            h[draw(st.sampled_from(sorted(h)))] = draw(msgpack_values)
            frames[0] = msgpack.packb(h)
    return frames


@FUZZ_MID
@given(mutated())
def test_mutated_valid_messages(frames):
    decode_or_refuse(frames, max_frame_bytes=1 << 16)


@FUZZ_SMALL
@given(st.sampled_from(["float32", "bfloat16", "int8", "x"]) | msgpack_values,
       st.lists(st.integers(-3, 2**41), max_size=10) | msgpack_values,
       st.integers(0, 3), st.binary(max_size=64))
def test_random_array_descriptors(dtype, shape, index, frame):
    desc = {"__frame__": index, "dtype": dtype, "shape": shape}
    body = msgpack.packb({"session_id": "s", "block": 0, "positions": [], "states": desc})
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": "hidden_states", "id": "x",
                            "session": "", "reply_to": None, "t_ns": 0})
    env = decode_or_refuse([header, body, frame], max_frame_bytes=1 << 20)
    if env is not None:
        assert isinstance(env.msg.states, np.ndarray) and env.msg.states.nbytes == len(frame)
