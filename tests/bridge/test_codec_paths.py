"""The codec's less travelled paths, and the exact error each refusal gives.

Written from the mutants of bridge/codec.py that survived the older tests (issue 36,
results/mutation.json): arrays inside a fixed tuple, a dict and a nested struct, a field typed
`None`, a class's own checks, numpy bools, the header's msgpack limits, and the message of every
refusal (what a peer reads in the ErrorReply, or a sender in its TypeError).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import pytest

from bridge import codec
from bridge.card import PROTOCOL_VERSION, AgentCard
from bridge.errors import ProtocolError
from bridge.messages import (DraftReply, GenerateChunk, RunPreset, StatusReply, equal, example,
                             message)

pytestmark = pytest.mark.timeout(30)


@dataclass(frozen=True)
class _Holder:
    arr: np.ndarray


@message("test.codec.paths")
class Paths:
    """Arrays wherever a field may hold one, a field typed None, unions without int, and a
    check of its own."""

    pair: tuple[np.ndarray, int]
    by_name: dict[str, np.ndarray]
    holder: _Holder
    nothing: None
    count: int = 0
    ratio: float | str = 0.5  # a union without int
    label: str | bytes = ""  # a union without int or float

    def __post_init__(self) -> None:
        if self.count > 1000:
            raise ValueError(f"count {self.count} is over 1000: " + "!" * 250)


def header(**over):
    h = {"v": PROTOCOL_VERSION, "type": "ping", "id": "abc", "session": "", "reply_to": None,
         "t_ns": 1}
    h.update(over)
    return msgpack.packb(h)


PING = msgpack.packb({"seq": 1, "sent_ns": 2})


def refusal(frames, **kw) -> tuple[str, str, str | None]:
    with pytest.raises(ProtocolError) as e:
        codec.decode(frames, **kw)
    return e.value.code, e.value.message, e.value.msg_id


def encode_error(msg) -> str:
    with pytest.raises((TypeError, ValueError)) as e:
        codec.encode(msg)
    return f"{type(e.value).__name__}: {e.value}"


# --- shapes of messages ------------------------------------------------------------------------


def test_arrays_travel_inside_tuples_dicts_and_nested_structs():
    a, b, c = (np.arange(n, dtype=np.float32) for n in (2, 3, 4))
    msg = Paths((a, 7), {"b": b}, _Holder(c), None)
    frames = codec.encode(msg)
    assert len(frames) == 5  # header, body, one frame per array
    got = codec.decode(frames).msg
    assert equal(got, msg) and got.pair[1] == 7
    assert [got.pair[0].tolist(), got.by_name["b"].tolist(), got.holder.arr.tolist()] == [
        [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert equal(codec.decode(codec.encode(example(Paths))).msg, example(Paths))


def test_a_field_typed_none_carries_only_none():
    msg = Paths((np.zeros(1, np.float32), 1), {}, _Holder(np.zeros(1, np.float32)), None)
    body = msgpack.unpackb(codec.encode(msg)[1])
    assert body["nothing"] is None
    assert encode_error(Paths(msg.pair, {}, msg.holder, 0)) == \
        "TypeError: test.codec.paths.nothing: expected None"
    frames = codec.encode(msg)
    bad = msgpack.packb(dict(body, nothing=0))
    assert refusal([header(type="test.codec.paths"), bad, *frames[2:]]) == (
        "malformed", "test.codec.paths.nothing: expected none, got int", "abc")


def test_an_int_for_a_union_without_int_becomes_a_float_if_float_is_a_member():
    msg = Paths((np.zeros(1, np.float32), 1), {}, _Holder(np.zeros(1, np.float32)), None)
    frames = codec.encode(msg)
    body = msgpack.unpackb(frames[1])
    for wire, want in ((2, 2.0), (2.5, 2.5), ("x", "x")):
        got = codec.decode([header(type="test.codec.paths"), msgpack.packb(dict(body, ratio=wire)),
                            *frames[2:]]).msg.ratio
        assert got == want and type(got) is type(want)
    bad = msgpack.packb(dict(body, ratio=True))
    assert refusal([header(type="test.codec.paths"), bad, *frames[2:]]) == (
        "malformed", "test.codec.paths.ratio: expected union, got bool", "abc")
    bad = msgpack.packb(dict(body, label=2))
    assert refusal([header(type="test.codec.paths"), bad, *frames[2:]]) == (
        "malformed", "test.codec.paths.label: expected union, got int", "abc")


def test_a_class_refusing_its_fields_is_malformed_and_the_message_is_cut_to_200():
    msg = Paths((np.zeros(1, np.float32), 1), {}, _Holder(np.zeros(1, np.float32)), None)
    frames = codec.encode(msg)
    bad = msgpack.packb(dict(msgpack.unpackb(frames[1]), count=5000))
    code, text, msg_id = refusal([header(type="test.codec.paths"), bad, *frames[2:]])
    assert (code, msg_id) == ("malformed", "abc")
    assert text == ("test.codec.paths: count 5000 is over 1000: " + "!" * 250)[:200]


def test_a_numpy_bool_goes_out_as_a_bool():
    got = codec.decode(codec.encode(DraftReply("s", 1, [1], None, 1.0, np.bool_(True)))).msg
    assert got.predraft_hit is True


def test_a_default_header_has_no_session_no_reply_and_a_64_bit_hex_id():
    env = codec.decode(codec.encode(RunPreset("p", {})))
    assert env.header.session == "" and env.header.reply_to is None
    for ident in (env.header.id, codec.new_id()):
        assert len(ident) == 16 and int(ident, 16) >= 0
    assert len({codec.new_id() for _ in range(100)}) == 100


# --- what a sender's bug says ------------------------------------------------------------------


def test_encoding_errors_name_the_path_what_was_expected_and_what_came():
    card = AgentCard("n", "m", "f", "h", 1, 2)
    cases = [
        (GenerateChunk("r", [1], 5), "TypeError: generate_chunk.text: expected str, got int"),
        (GenerateChunk("r", [1, True], "t"),
         "TypeError: generate_chunk.token_ids[1]: expected int, got bool"),
        (GenerateChunk("r", 5, "t"),
         "TypeError: generate_chunk.token_ids: expected a sequence, got int"),
        (RunPreset("p", {"a": True}),
         "TypeError: run_preset.params['a']: bool is not one of ['float', 'int', 'str']"),
        (RunPreset("p", {"a": 2**70}),
         f"ValueError: run_preset.params['a']: {2**70} does not fit in 64 bits"),
        (RunPreset("p", {1: 2}), "TypeError: run_preset.params: expected a dict with str keys"),
        (RunPreset("p", ["a"]), "TypeError: run_preset.params: expected a dict with str keys"),
        (DraftReply("s", 1, [1], None, 1.0, False, parents=[True]),
         "TypeError: draft_reply.parents[0]: expected int, got bool"),
        (DraftReply("s", 1, [1], None, 1.0, "yes"),
         "TypeError: draft_reply.predraft_hit: expected bool, got str"),
        (StatusReply({}, 1, 2.0, 0.1, 3, 4),
         "TypeError: status.card: expected AgentCard, got dict"),
        (StatusReply(AgentCard("n", "m", "f", "h", 1, "2"), 1, 2.0, 0.1, 3, 4),
         "TypeError: status.card.pub_port: expected int, got str"),
        (StatusReply(AgentCard("n", "m", "f", "h", 1, 2, extra=(("a",),)), 1, 2.0, 0.1, 3, 4),
         "ValueError: status.card.extra[0]: expected 2 items, got 1"),
        (StatusReply(AgentCard("n", "m", "f", "h", 1, 2, extra=(("a", 5),)), 1, 2.0, 0.1, 3, 4),
         "TypeError: status.card.extra[0][1]: expected str, got int"),
    ]
    assert codec.encode(StatusReply(card, 1, 2.0, 0.1, 3, 4))
    for msg, text in cases:
        assert encode_error(msg) == text


# --- what a peer reads back --------------------------------------------------------------------


def test_decoding_errors_say_what_was_refused():
    long_keys = {f"{i}" + "k" * 50: 0 for i in range(7)}
    cut = [f"'{i}" + "k" * 38 for i in range(5)]  # five of them, each repr cut to 40
    for frames, kw, want in [
        ([header(), msgpack.packb({"seq": 1})], {},
         ("malformed", "ping: missing fields ['sent_ns'], unexpected []", "abc")),
        ([header(), msgpack.packb({"seq": 1, "sent_ns": 2, **long_keys})], {},
         ("malformed", f"ping: missing fields [], unexpected {cut}", "abc")),
        ([header(type="run_preset"), msgpack.packb({"preset": "p", "params": ["a"]})], {},
         ("malformed", "run_preset.params: expected dict, got list", "abc")),
        ([header(type="run_preset"), msgpack.packb({"preset": "p", "params": 5})], {},
         ("malformed", "run_preset.params: expected dict, got int", "abc")),
        ([header(), b"\x00" * 100], dict(max_body_bytes=50),
         ("oversize", "body of 100 bytes exceeds 50", "abc")),
        ([header(), PING, b"x", b"y"], {},
         ("malformed", "2 buffer frames not referenced", "abc")),
        (["text", PING], {}, ("malformed", "frames must be bytes-like", None)),
        # a map key that is not a string is refused by msgpack itself (strict_map_key)
        ([header(), msgpack.packb({1: 2})], {}, ("malformed", "not msgpack: ValueError", "abc")),
    ]:
        assert refusal(frames, **kw) == want


def test_decode_applies_its_header_limit():
    h = header()
    assert codec.decode([h, PING], max_header_bytes=len(h)).msg.seq == 1
    assert refusal([h, PING], max_header_bytes=len(h) - 1) == (
        "oversize", f"header of {len(h)} bytes exceeds {len(h) - 1}", None)


@pytest.mark.parametrize("field", ["type", "session", "reply_to"])
def test_a_header_value_holding_more_than_16_items_is_refused_by_msgpack(field):
    """The header's msgpack runs with 16 items at most per array or map: a bigger one is not
    parsed at all (so carries no id); 16 parse and are refused as a wrong field."""
    for big in (list(range(17)), {str(i): 0 for i in range(17)}):
        assert refusal([header(**{field: big}), PING]) == (
            "malformed", "not msgpack: ValueError", None)
    for ok in (list(range(16)), {str(i): 0 for i in range(16)}):
        assert refusal([header(**{field: ok}), PING]) == (
            "malformed", "header field of the wrong type or size", "abc")


def test_header_and_body_may_come_as_any_buffer():
    """Frames are read as their bytes, header and body included: msgpack refuses a buffer of
    multi-byte items (BufferError), so decode casts such views to bytes first."""
    for i in range(4):  # a header and a body of an even number of bytes, as uint16 items
        h = header(id="a" * (3 + i))
        if len(h) % 2 == 0:
            break
    body = next(b for b in (msgpack.packb({"seq": s, "sent_ns": 2}) for s in (1, 200, 300, 70000))
                if len(b) % 2 == 0)
    want = codec.decode([h, body]).msg
    for shape in ((-1,), (1, -1)):
        frames = [np.frombuffer(f, np.uint16).reshape(shape) for f in (h, body)]
        assert codec.decode(frames).msg == want
