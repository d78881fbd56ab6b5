"""Codec, arrays and message registry: round trips of every message, typed errors for each
malformed case."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest

from bridge import arrays, codec, messages
from bridge.card import PROTOCOL_VERSION, AgentCard
from bridge.errors import CODES, ProtocolError
from bridge.messages import (DraftReply, ErrorReply, GenerateChunk, GenerateDone, HiddenStates,
                             Ping, StatusReply, equal, example, message, registry)

pytestmark = pytest.mark.timeout(30)


@dataclass(frozen=True)
class _Inner:
    name: str
    pair: tuple[int, str]


@message("test.codec.kitchen_sink")
class KitchenSink:
    """Every supported field kind, so the codec is exercised beyond the product messages."""

    raw: bytes
    flag: bool
    maybe: float | None
    scalar: int | str
    ids: list[int]
    names: tuple[str, ...]
    table: dict[str, float | int | str]
    inner: _Inner
    inners: list[_Inner]
    mats: list[np.ndarray]
    opt_arr: np.ndarray | None


ALL_TAGS = sorted(registry())
DTYPES = sorted(arrays.ALLOWED_DTYPES)


def roundtrip(msg, **kw):
    env = codec.decode(codec.encode(msg, **kw))
    assert equal(msg, env.msg), (msg, env.msg)
    return env


def header(**over):
    h = {"v": PROTOCOL_VERSION, "type": "ping", "id": "abc", "session": "", "reply_to": None, "t_ns": 1}
    h.update(over)
    return msgpack.packb(h)


def expect(code, frames, **kw):
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames, **kw)
    assert info.value.code == code, info.value
    return info.value


# --- round trips -----------------------------------------------------------------------------


def test_registry_has_every_product_message():
    for tag in ("ping", "pong", "error", "status_request", "status", "open_session", "session_opened",
                "draft_request", "draft_reply", "hidden_states", "close_session", "session_closed",
                "generate", "generate_chunk", "generate_done", "block_metrics", "agent_event",
                "run_preset", "preset_result"):
        assert tag in registry()


@pytest.mark.parametrize("tag", ALL_TAGS)
@pytest.mark.parametrize("variant", [dict(), dict(seed=3, none=True), dict(seed=5, dtype="int8")])
def test_every_message_roundtrips(tag, variant):
    roundtrip(example(registry()[tag], **variant))


@pytest.mark.parametrize("dtype", DTYPES)
def test_array_fields_roundtrip_in_every_dtype(dtype):
    for cls in (DraftReply, HiddenStates, KitchenSink):
        env = roundtrip(example(cls, dtype=dtype))
        arr = env.msg.states if cls is HiddenStates else None
        if arr is not None:
            assert arrays.is_bfloat16(arr) == (dtype == "bfloat16")
            assert not arr.flags.writeable


def test_header_fields_travel():
    env = roundtrip(Ping(1, 2), msg_id="m1", session="sess", reply_to="r0", t_ns=42)
    assert env.header == codec.Header(PROTOCOL_VERSION, "ping", "m1", "sess", "r0", 42)
    assert env.nbytes == codec.frames_nbytes(codec.encode(Ping(1, 2), msg_id="m1", session="sess",
                                                         reply_to="r0", t_ns=42))


def test_arrays_travel_as_frames_not_in_msgpack():
    probs = np.random.default_rng(0).random((4, 1000), dtype=np.float32)
    frames = codec.encode(DraftReply("s", 1, [1, 2, 3, 4], probs, 1.0, False))
    assert len(frames) == 3
    assert len(frames[1]) < 200 and memoryview(frames[2]).nbytes == probs.nbytes


def test_decode_is_zero_copy():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = [bytes(f) if i < 2 else bytearray(f) for i, f in enumerate(codec.encode(
        HiddenStates("s", 0, [0, 1, 2], arr)))]
    states = codec.decode(frames).msg.states
    frames[2][:4] = np.float32(99).tobytes()
    assert states[0, 0] == 99


@pytest.mark.parametrize("arr", [
    np.zeros((0, 5), np.float32), np.array(3.5, np.float16), np.arange(10, dtype=">i4"),
    np.arange(24, dtype=np.int64).reshape(2, 3, 4)[:, ::2, 1:], np.asfortranarray(np.eye(3, dtype=np.float32)),
])
def test_array_edge_cases(arr):
    out = codec.decode(codec.encode(HiddenStates("s", 0, [], arr))).msg.states
    assert out.shape == arr.shape and np.array_equal(out, arr) and out.dtype.byteorder in "=<|"


def test_bfloat16_bits_roundtrip():
    bits = arrays.as_bfloat16(np.array([0x3F80, 0x4000], np.uint16))  # 1.0, 2.0
    out = codec.decode(codec.encode(HiddenStates("s", 0, [0, 1], bits))).msg.states
    assert arrays.is_bfloat16(out) and out.tolist() == [0x3F80, 0x4000]
    with pytest.raises(TypeError):  # untagged uint16 is not a wire dtype: no silent guess
        codec.encode(HiddenStates("s", 0, [0, 1], bits.view(np.uint16)))


def test_encode_coerces_numpy_scalars_and_sequences():
    msg = GenerateChunk("r", np.array([1, 2, 3]), "t")
    assert codec.decode(codec.encode(msg)).msg.token_ids == [1, 2, 3]
    assert codec.decode(codec.encode(Ping(np.int64(4), 5))).msg.seq == 4


@pytest.mark.parametrize("msg", [
    Ping("1", 2), Ping(True, 2), Ping(1.5, 2), Ping(2**70, 0),
    GenerateDone("r", "t", [1], {"a": True}), GenerateDone("r", "t", [1], {1: 2}),
    HiddenStates("s", 0, [], np.zeros(2, np.float64)), HiddenStates("s", 0, [], [1.0]),
    ErrorReply(None, "m"),
])
def test_encode_refuses_bad_fields(msg):
    with pytest.raises((TypeError, ValueError)):
        codec.encode(msg)


def test_encode_refuses_unregistered():
    with pytest.raises(TypeError):
        codec.encode(_Inner("a", (1, "b")))


# --- registry --------------------------------------------------------------------------------


def test_decorator_makes_frozen_dataclass_and_flags_terminal():
    assert messages.is_terminal(GenerateDone) and not messages.is_terminal(GenerateChunk)
    with pytest.raises(AttributeError):
        Ping(1, 2).seq = 3  # type: ignore[misc]


def test_registry_refuses_bad_classes():
    with pytest.raises(ValueError):
        message("ping")(type("Other", (), {"__annotations__": {"x": int}}))
    with pytest.raises(TypeError):
        message("test.codec.bad_type")(type("Bad", (), {"__annotations__": {"x": set}}))
    with pytest.raises(TypeError):
        message("test.codec.not_frozen")(dataclass(type("Loose", (), {"__annotations__": {"x": int}})))
    with pytest.raises(ProtocolError) as info:
        messages.message_class("nope")
    assert info.value.code == "unknown_type"


def test_equal_compares_arrays():
    a = HiddenStates("s", 0, [1], np.ones((1, 2), np.float32))
    assert equal(a, HiddenStates("s", 0, [1], np.ones((1, 2), np.float32)))
    assert not equal(a, HiddenStates("s", 0, [1], np.ones((1, 2), np.float16)))
    assert not equal(a, HiddenStates("s", 0, [1], np.zeros((1, 2), np.float32)))


def test_status_reply_carries_agent_card():
    card = AgentCard("n1", "mac", "fid", "10.0.0.2", 5555, 5556, roles=("proposer",),
                     extra=(("k", "v"),))
    assert roundtrip(messages.StatusReply(card, 1, 2.5, 0.1, 3, 4)).msg.card == card


# --- typed errors ----------------------------------------------------------------------------


def body(**fields):
    return msgpack.packb(fields)


def test_frame_count_and_garbage():
    expect("malformed", [])
    expect("malformed", [header()])
    expect("malformed", [b"\xc1", body(seq=1, sent_ns=2)])  # 0xc1 is never valid msgpack
    expect("malformed", [msgpack.packb([1, 2]), body(seq=1, sent_ns=2)])
    expect("malformed", [header(), b"\x93\x01"])  # truncated
    expect("malformed", [header(), body(seq=1, sent_ns=2) + b"\x00"])  # trailing bytes
    expect("malformed", ["not bytes", body()])
    expect("oversize", [header(), body(seq=1, sent_ns=2), *[b""] * 70])


def test_header_errors():
    assert expect("bad_version", [header(v=PROTOCOL_VERSION + 1), body(seq=1, sent_ns=2)]).msg_id == "abc"
    expect("bad_version", [msgpack.packb({"v": 99}), b""])
    expect("malformed", [header(v="1"), body(seq=1, sent_ns=2)])
    expect("malformed", [header(extra=1), body(seq=1, sent_ns=2)])
    expect("malformed", [header(t_ns="now"), body(seq=1, sent_ns=2)])
    expect("malformed", [header(id=""), body(seq=1, sent_ns=2)])
    expect("malformed", [header(reply_to=5), body(seq=1, sent_ns=2)])
    expect("oversize", [header(session="x" * 5000), body(seq=1, sent_ns=2)])
    err = expect("unknown_type", [header(type="nope"), body()])
    assert err.msg_id == "abc"


@pytest.mark.parametrize("fields", [
    dict(seq=1), dict(seq=1, sent_ns=2, more=3), dict(seq="1", sent_ns=2), dict(seq=True, sent_ns=2),
    dict(seq=1.0, sent_ns=2), dict(seq=None, sent_ns=2), dict(seq=[1], sent_ns=2),
])
def test_field_errors(fields):
    assert expect("malformed", [header(), body(**fields)]).msg_id == "abc"


def test_nested_field_errors():
    good = msgpack.unpackb(codec.encode(example(GenerateDone))[1])
    for field, value in [("token_ids", [1, "2"]), ("token_ids", 5), ("stats", {"a": [1]}),
                         ("stats", [1]), ("text", b"bytes")]:
        bad = dict(good, **{field: value})
        expect("malformed", [header(type="generate_done"), msgpack.packb(bad)])
    expect("malformed", [header(), msgpack.packb({1: 2})])  # non-str keys
    expect("malformed", [header(), msgpack.packb([1, 2])])
    expect("malformed", [header(), msgpack.packb({"seq": msgpack.ExtType(1, b"x"), "sent_ns": 1})])


def test_field_errors_say_where_what_was_expected_and_what_came():
    """A peer's bug report is the message: the field's path, the kind it should be and the
    type that came (each part checked, so a message that loses one fails)."""
    good = msgpack.unpackb(codec.encode(example(GenerateDone))[1])
    for field, value, message in [
            ("token_ids", [1, "2"], "generate_done.token_ids[1]: expected int, got str"),
            ("text", b"x", "generate_done.text: expected str, got bytes"),
            ("stats", [1], "generate_done.stats: expected struct, got list")]:
        bad = msgpack.packb(dict(good, **{field: value}))
        assert expect("malformed", [header(type="generate_done"), bad]).message == message


def test_error_replies_are_cut_to_1000_characters_and_carry_no_invented_session():
    env = codec.decode(codec.encode_error(ProtocolError("internal", "x" * 5000, msg_id="q")))
    assert env.msg == ErrorReply("internal", "x" * 1000)
    assert env.header.reply_to == "q" and env.header.session == ""
    short = codec.decode(codec.encode_error(ProtocolError("busy", "y" * 1000))).msg
    assert short.message == "y" * 1000


def test_encoding_checks_ints_and_floats_at_their_edges():
    """What msgpack carries, exactly: ints in [-2**63, 2**64 - 1] (both ends included), no bool
    for an int or a float, no string for a float; the error names the field and the type."""
    for seq, ns in [(2**64 - 1, -(2**63)), (-(2**63), 2**64 - 1)]:
        assert codec.decode(codec.encode(Ping(seq, ns))).msg == Ping(seq, ns)
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError) as e:
            codec.encode(Ping(bad, 0))
        assert str(e.value) == f"ping.seq: {bad} does not fit in 64 bits"
    with pytest.raises(TypeError) as e:
        codec.encode(Ping(True, 1))
    assert str(e.value) == "ping.seq: expected int, got bool"
    for value, kind in [("1.5", "str"), (True, "bool"), (None, "NoneType")]:
        with pytest.raises(TypeError) as e:
            codec.encode(DraftReply("s", 1, [1], None, value, False))
        assert str(e.value) == f"draft_reply.draft_ms: expected float, got {kind}"
    ok = codec.decode(codec.encode(DraftReply("s", 1, [1], None, np.float32(1.5), False))).msg
    assert ok.draft_ms == 1.5 and type(ok.draft_ms) is float


def test_array_frames_over_the_limit_are_oversize_whichever_side_says_so():
    """max_frame_bytes bounds both what a descriptor declares and what a frame holds: each is
    refused as oversize on its own (a descriptor over the limit is not left to be found later
    as a shape mismatch), and a bad descriptor or frame index says which."""
    desc = {"__frame__": 0, "dtype": "float32", "shape": [4]}  # declares 16 bytes
    e = expect("oversize", hidden(desc, [b"\0" * 4]), max_frame_bytes=8)
    assert e.message == "shape [4] exceeds 8 bytes"
    e = expect("oversize", hidden(dict(desc, shape=[1]), [b"\0" * 16]), max_frame_bytes=8)
    assert e.message == "frame of 16 bytes exceeds 8"
    e = expect("malformed", hidden({"dtype": "float32", "shape": [1]}, [b"\0" * 4]))
    assert e.message == "hidden_states.states: expected an array descriptor"
    e = expect("malformed", hidden(dict(desc, __frame__=1), [b"\0" * 16]))
    assert e.message == "hidden_states.states: bad or reused frame index"


def _decoded(tag: str, fields: dict):
    return codec.decode([header(type=tag), msgpack.packb(fields)]).msg


def test_decoding_follows_each_kind_of_field():
    """What another msgpack writer may send, kind by kind: a float packed as an int becomes a
    float; a union keeps each member's own type and refuses anything else (bool is no int, and
    no float is made of it); a fixed-size tuple refuses another length; an optional field's
    error names its path."""
    dr = msgpack.unpackb(codec.encode(DraftReply("s", 1, [1], None, 1.5, False))[1])
    got = _decoded("draft_reply", dict(dr, draft_ms=1)).draft_ms
    assert got == 1.0 and type(got) is float
    e = expect("malformed", [header(type="draft_reply"), msgpack.packb(dict(dr, parents="x"))])
    assert e.message == "draft_reply.parents: expected list, got str"
    params = _decoded("run_preset", {"preset": "p", "params": {"a": 1, "b": 1.5, "c": "s"}}).params
    assert params == {"a": 1, "b": 1.5, "c": "s"} and [type(v) for v in params.values()] == [
        int, float, str]
    for value, kind in [(True, "bool"), (b"x", "bytes"), ([1], "list")]:
        bad = msgpack.packb({"preset": "p", "params": {"a": value}})
        e = expect("malformed", [header(type="run_preset"), bad])
        assert e.message == f"run_preset.params['a']: expected union, got {kind}"
    st = msgpack.unpackb(codec.encode(example(StatusReply))[1])
    assert _decoded("status", {**st, "card": {**st["card"], "extra": [["a", "b"]]}}
                    ).card.extra == (("a", "b"),)
    for pair in (["a", "b", "c"], ["a"]):
        bad = msgpack.packb({**st, "card": {**st["card"], "extra": [pair]}})
        e = expect("malformed", [header(type="status"), bad])
        assert e.message == "status.card.extra[0]: expected tuple, got list"
    e = expect("malformed", [header(type="generate_done"), msgpack.packb(
        dict(msgpack.unpackb(codec.encode(example(GenerateDone))[1]), token_ids=5))])
    assert e.message == "generate_done.token_ids: expected list, got int"


def hidden(desc, frames, **kw):
    b = msgpack.packb({"session_id": "s", "block": 0, "positions": [], "states": desc})
    return [header(type="hidden_states"), b, *frames]


def test_limits_decode_applies_each_of_its_caps():
    """A socket's Limits: each cap refuses one past it and lets the limit itself through."""
    desc = {"__frame__": 0, "dtype": "float32", "shape": [2]}
    msg = hidden(desc, [b"\0" * 8])  # 3 frames, an 8-byte buffer
    body_bytes = len(msg[1])
    assert codec.Limits(max_frame_bytes=8, max_frames=3, max_body_bytes=body_bytes).decode(msg)
    for limits in (codec.Limits(max_frame_bytes=7), codec.Limits(max_frames=2),
                   codec.Limits(max_body_bytes=body_bytes - 1)):
        with pytest.raises(ProtocolError) as e:
            limits.decode(msg)
        assert e.value.code == "oversize", limits
    assert expect("oversize", msg, max_frames=2).message == "3 frames exceed 2"


def test_any_buffer_is_a_frame_read_as_its_bytes():
    """Frames may be any buffer (a numpy array of floats, a 2-D one): read as their bytes."""
    x = np.array([1.5, -2.5], dtype=np.float32)
    desc = {"__frame__": 0, "dtype": "float32", "shape": [2]}
    for frame in (x, x.view(np.uint8).reshape(2, 4), x.view(np.uint16)):
        got = codec.decode(hidden(desc, [frame])).msg.states
        assert got.tolist() == [1.5, -2.5]
    with pytest.raises(ProtocolError) as e:
        codec.decode(iter(()))
    assert (e.value.code, e.value.message) == ("malformed", "need at least 2 frames, got 0")
    with pytest.raises(ProtocolError) as e:
        codec.decode(5)
    assert (e.value.code, e.value.message) == ("malformed", "frames must be a sequence")
    e = expect("malformed", [header(), msgpack.packb({"seq": msgpack.ExtType(1, b"x")})])
    assert e.message.startswith("not msgpack: ")


def test_header_limits_are_inclusive_and_errors_stay_addressed():
    """Each header size limit admits exactly its value and refuses one more; errors found
    after the id was read carry it (so the refusal reaches the sender); peek_id reads it."""
    def dh(frame, **kw):
        return codec.decode_header(frame, **kw)

    h = header()
    assert dh(h, max_bytes=len(h)).id == "abc"
    with pytest.raises(ProtocolError) as e:
        dh(h, max_bytes=len(h) - 1)
    assert (e.value.code, e.value.message) == ("oversize",
                                               f"header of {len(h)} bytes exceeds {len(h) - 1}")
    for field, limit in (("id", codec.MAX_ID_LEN), ("type", codec.MAX_TAG_LEN),
                         ("session", codec.MAX_SESSION_LEN), ("reply_to", codec.MAX_ID_LEN)):
        assert getattr(dh(header(**{field: "x" * limit})), field) == "x" * limit
        with pytest.raises(ProtocolError) as e:
            dh(header(**{field: "x" * (limit + 1)}))
        assert e.value.code == "malformed"
        assert e.value.msg_id == (None if field == "id" else "abc")
    assert dh(header(type="p")).type == "p"
    for bad, message in [(dict(v="1"), "header has no int version"),
                         (dict(extra=1), "header keys differ from " + ",".join(
                             sorted(["v", "type", "id", "session", "reply_to", "t_ns"]))),
                         (dict(type=""), "header field of the wrong type or size")]:
        with pytest.raises(ProtocolError) as e:
            dh(header(**bad))
        assert (e.value.code, e.value.message, e.value.msg_id) == ("malformed", message, "abc")
    with pytest.raises(ProtocolError) as e:
        dh(header(v=PROTOCOL_VERSION + 1))
    assert (e.value.code, e.value.msg_id) == ("bad_version", "abc")
    assert e.value.message == f"protocol {PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}"
    for frame, message in [("text", "header must be bytes-like"),
                           (msgpack.packb([1]), "header is not a map")]:
        with pytest.raises(ProtocolError) as e:
            dh(frame)
        assert (e.value.code, e.value.message) == ("malformed", message)
    assert codec.peek_id(header(id="r9")) == "r9" and codec.peek_id(b"\xc1") is None


def test_array_descriptor_errors():
    ok = {"__frame__": 0, "dtype": "float32", "shape": [2]}
    codec.decode(hidden(ok, [b"\0" * 8]))
    expect("bad_dtype", hidden(dict(ok, dtype="float64"), [b"\0" * 8]))
    expect("bad_dtype", hidden(dict(ok, dtype="object"), [b"\0" * 8]))
    expect("bad_dtype", hidden(dict(ok, dtype=7), [b"\0" * 8]))
    expect("bad_shape", hidden(dict(ok, shape=[3]), [b"\0" * 8]))
    expect("bad_shape", hidden(dict(ok, shape=[-2]), [b"\0" * 8]))
    expect("bad_shape", hidden(dict(ok, shape=[2.0]), [b"\0" * 8]))
    expect("bad_shape", hidden(dict(ok, shape="2"), [b"\0" * 8]))
    expect("bad_shape", hidden(dict(ok, shape=[1] * 9), [b"\0" * 4]))
    expect("oversize", hidden(dict(ok, shape=[0, 2**40, 2**40]), [b""]))
    expect("oversize", hidden(dict(ok, shape=[4]), [b"\0" * 16]), max_frame_bytes=8)
    expect("malformed", hidden(dict(ok, __frame__=1), [b"\0" * 8]))
    expect("malformed", hidden(dict(ok, __frame__=-1), [b"\0" * 8]))
    expect("malformed", hidden({"dtype": "float32", "shape": [2]}, [b"\0" * 8]))
    expect("malformed", hidden(dict(ok, extra=1), [b"\0" * 8]))
    expect("malformed", hidden(ok, [b"\0" * 8, b"spare"]))  # unreferenced frame
    expect("malformed", hidden(ok, []))


def test_reused_frame_index_is_malformed():
    desc = {"__frame__": 0, "dtype": "uint8", "shape": [1]}
    b = msgpack.packb({**msgpack.unpackb(codec.encode(example(KitchenSink))[1]),
                       "mats": [desc, desc], "opt_arr": None})
    expect("malformed", [header(type="test.codec.kitchen_sink"), b, b"\0"])


def test_msgpack_bombs():
    expect("malformed", [header(), b"\x91" * 100_000 + b"\x00"])  # nesting
    expect("malformed", [header(), b"\xdd\xff\xff\xff\xff"])  # array32 claiming 4G items
    expect("malformed", [header(), b"\xdf\xff\xff\xff\xff"])  # map32
    expect("malformed", [header(), b"\xdb\xff\xff\xff\xff"])  # str32
    expect("malformed", [header(), b"\xc6\xff\xff\xff\xff"])  # bin32
    expect("oversize", [header(), b"\x00" * 100], max_body_bytes=50)


def test_error_reply_is_addressed():
    exc = ProtocolError("bad_shape", "nope", msg_id="req1")
    env = codec.decode(codec.encode_error(exc))
    assert env.msg == ErrorReply("bad_shape", "nope") and env.header.reply_to == "req1"
    req = codec.decode(codec.encode(Ping(1, 1), msg_id="r2", session="s")).header
    env = codec.decode(codec.encode_error(exc, request=req))
    assert env.header.reply_to == "r2" and env.header.session == "s"
    assert {"unknown_type", "bad_version", "malformed", "bad_shape", "bad_dtype", "oversize", "auth",
            "bad_request", "not_found", "busy", "internal", "timeout", "unavailable",
            "forbidden"} == CODES


def test_generation_stats_travel_nested_and_are_validated_field_by_field():
    from macfleet.stats import FleetStats, FlowStats, GenerationStats, ProposerStats

    st = GenerationStats(tokens=3, elapsed_s=0.5, accepted_hist=(1, 2),
                         per_proposer=(ProposerStats("ngram", 4, 2),),
                         fleet=FleetStats(verifier="v", proposer_agents=("a", "b"),
                                          flows=FlowStats(remote_blocks=2, f3_probe=True)))
    got = roundtrip(GenerateDone("r", "t", [1, 2, 3], st)).msg.stats
    assert got == st and isinstance(got.fleet.flows, FlowStats)
    good = msgpack.unpackb(codec.encode(GenerateDone("r", "t", [1], st))[1])
    for path, value in [(("fleet", "flows", "remote_blocks"), "2"),
                        (("fleet", "proposer_agents"), [1]),
                        (("per_proposer",), [{"name": "x"}]),
                        (("accepted_hist",), [1.5]),
                        (("fleet", "flows", "f3_probe"), 1)]:
        bad = copy.deepcopy(good)
        node = bad["stats"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        expect("malformed", [header(type="generate_done"), msgpack.packb(bad)])
    with pytest.raises(TypeError):  # the sender's bug, caught before anything is sent
        codec.encode(GenerateDone("r", "t", [1], st.to_dict()))


def test_error_codes_are_named_by_their_constants_only():
    """Product code names an error code through bridge.errors (INTERNAL, ...), never as a string
    literal: in ProtocolError/ErrorReply calls and in comparisons with `.code`."""
    import ast
    import re

    from sourcescan import ROOT, nodes, product_files

    from bridge.errors import CODES

    # only a file that names one of the calls or reads a `.code` can break the rule: the
    # others are not parsed (this worker may be the only one of the run to need the parse)
    could = re.compile(r"ProtocolError|ErrorReply|\.\s*code\b")
    bad = []
    for path in product_files():
        if path.name == "errors.py" and path.parent.name == "bridge":
            continue
        if not could.search(path.read_text(encoding="utf-8")):
            continue
        for node in nodes(path):
            lits: list = []
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(
                    node.func, "attr", "")) in ("ProtocolError", "ErrorReply"):
                lits = node.args[:1] + [k.value for k in node.keywords if k.arg == "code"]
            elif isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and x.attr == "code"
                    for x in (node.left, *node.comparators)):
                for x in (node.left, *node.comparators):
                    lits += x.elts if isinstance(x, (ast.Tuple, ast.List, ast.Set)) else [x]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {x.value!r}" for x in lits
                    if isinstance(x, ast.Constant) and x.value in CODES]
    assert not bad, bad
