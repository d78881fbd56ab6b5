"""Messages <-> multipart frames `[header, body, *buffers]`. Pure: no sockets, no clocks but t_ns.

header: msgpack map `{v, type, id, session, reply_to, t_ns}`; `v` is checked first so a future
version is refused as bad_version rather than as malformed.
body: msgpack map of the message's fields; every ndarray is replaced by
`{"__frame__": i, "dtype": ..., "shape": [...]}` and its bytes are buffer frame i.

`decode` treats its input as hostile: sizes are capped before msgpack sees a byte, msgpack runs
with explicit length limits, and every value is checked against the message's compiled Spec.
Whatever is wrong, the only exception that leaves `decode` is ProtocolError with a code.
"""

from __future__ import annotations

import operator
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from bridge import arrays
from bridge.arrays import DEFAULT_MAX_FRAME_BYTES
from bridge.card import PROTOCOL_VERSION
from bridge.errors import BAD_VERSION, MALFORMED, OVERSIZE, ProtocolError
from bridge.messages import ErrorReply, Message, Spec, message_class, schema, tag_of

DEFAULT_MAX_FRAMES = 64  # header + body + buffers
DEFAULT_MAX_HEADER_BYTES = 4096
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # a long prompt as token ids, generated text
MAX_MAP_LEN = 65536
MAX_ID_LEN = 128
MAX_TAG_LEN = 128
MAX_SESSION_LEN = 512
_HEADER_KEYS = frozenset({"v", "type", "id", "session", "reply_to", "t_ns"})
_FRAME_KEYS = frozenset({"__frame__", "dtype", "shape"})
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry

Frames = list  # list[bytes | memoryview]: header and body are bytes, buffers are views


@dataclass(frozen=True)
class Header:
    v: int
    type: str
    id: str
    session: str
    reply_to: str | None
    t_ns: int  # sender's wall clock (unix ns); no receiver checks it (no replay window: auth.py)


@dataclass(frozen=True)
class Envelope:
    header: Header
    msg: Message
    nbytes: int  # bytes of all frames as received: what crossed the link


@dataclass(frozen=True)
class Limits:
    """Caps on what a receiver accepts per message (sockets keep one and decode with it)."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_frames: int = DEFAULT_MAX_FRAMES  # header + body + buffers
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def decode(self, frames: Sequence[Any]) -> Envelope:
        return decode(frames, max_frame_bytes=self.max_frame_bytes, max_frames=self.max_frames,
                      max_body_bytes=self.max_body_bytes)


def new_id() -> str:
    """A fresh message id: 64 random bits; a reply names the request it answers by it."""
    return secrets.token_hex(8)


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


# --- encode ----------------------------------------------------------------------------------


def encode(msg: Message, *, msg_id: str | None = None, session: str = "",
           reply_to: str | None = None, t_ns: int | None = None) -> Frames:
    """A registered message -> `[header, body, *buffers]`.

    Buffers alias the message's arrays (zero-copy): do not write to them until sent. A field that
    does not match its annotation raises TypeError/ValueError (a bug on our side, not the peer's).
    """
    tag = tag_of(msg)
    bufs: list[memoryview] = []
    body = _to_wire(schema(type(msg)), msg, bufs, tag)
    header = {"v": PROTOCOL_VERSION, "type": tag, "id": msg_id or new_id(), "session": session,
              "reply_to": reply_to, "t_ns": time.time_ns() if t_ns is None else t_ns}
    return [msgpack.packb(header), msgpack.packb(body), *bufs]


def _int(v: Any, path: str) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{path}: expected int, got bool")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{path}: expected int, got {type(v).__name__}") from None
    if not _INT_MIN <= i <= _INT_MAX:
        raise ValueError(f"{path}: {i} does not fit in 64 bits")
    return i


def _float(v: Any, path: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{path}: expected float, got {type(v).__name__}")
    return float(v)


def _exact(kind: str, v: Any) -> bool:
    if kind == "int":
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
    if kind == "float":
        return isinstance(v, (float, np.floating))
    if kind == "bool":
        return isinstance(v, (bool, np.bool_))
    return isinstance(v, (bytes, bytearray)) if kind == "bytes" else isinstance(v, str)


def _scalar_to_wire(kind: str, v: Any, path: str) -> Any:
    if kind == "int":
        return _int(v, path)
    if kind == "float":
        return _float(v, path)
    if not _exact(kind, v):
        raise TypeError(f"{path}: expected {kind}, got {type(v).__name__}")
    return bytes(v) if kind == "bytes" else bool(v) if kind == "bool" else v


def _to_wire(spec: Spec, v: Any, bufs: list[memoryview], path: str) -> Any:
    k = spec.kind
    if k in ("int", "float", "str", "bytes", "bool"):
        return _scalar_to_wire(k, v, path)
    if k == "none" or (k == "optional" and v is None):
        if v is not None:
            raise TypeError(f"{path}: expected None")
        return None
    if k == "optional":
        return _to_wire(spec.args[0], v, bufs, path)
    if k == "union":
        for a in spec.args:
            if _exact(a.kind, v):
                return _scalar_to_wire(a.kind, v, path)
        raise TypeError(f"{path}: {type(v).__name__} is not one of {[a.kind for a in spec.args]}")
    if k in ("list", "vartuple", "tuple"):
        if isinstance(v, np.ndarray) and k == "list" and v.ndim == 1:
            v = v.tolist()
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{path}: expected a sequence, got {type(v).__name__}")
        if k == "tuple":
            if len(v) != len(spec.args):
                raise ValueError(f"{path}: expected {len(spec.args)} items, got {len(v)}")
            return [_to_wire(a, x, bufs, f"{path}[{i}]") for i, (a, x) in enumerate(zip(spec.args, v))]
        return [_to_wire(spec.args[0], x, bufs, f"{path}[{i}]") for i, x in enumerate(v)]
    if k == "dict":
        if not isinstance(v, Mapping) or not all(isinstance(key, str) for key in v):
            raise TypeError(f"{path}: expected a dict with str keys")
        return {key: _to_wire(spec.args[0], x, bufs, f"{path}[{key!r}]") for key, x in v.items()}
    if k == "array":
        desc, frame = arrays.to_frame(v)
        bufs.append(frame)
        return {"__frame__": len(bufs) - 1, "dtype": desc.dtype, "shape": list(desc.shape)}
    if k == "struct":
        if not isinstance(v, spec.cls):
            raise TypeError(f"{path}: expected {spec.cls.__name__}, got {type(v).__name__}")
        return {n: _to_wire(a, getattr(v, n), bufs, f"{path}.{n}") for n, a in zip(spec.names, spec.args)}
    raise AssertionError(f"unhandled spec kind {k}")


# --- decode ----------------------------------------------------------------------------------


def _unpack(data: memoryview, *, max_len: int, max_map: int, max_array: int) -> Any:
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, max_str_len=max_len,
            max_bin_len=max_len, max_array_len=max_array, max_map_len=max_map, max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        # ValueError covers ExtraData, FormatError, StackError (nesting bombs), bad UTF-8.
        raise ProtocolError(MALFORMED, f"not msgpack: {type(exc).__name__}") from None


def _views(frames: Any, max_frames: int) -> list[memoryview]:
    try:
        items = list(frames)
    except TypeError:
        raise ProtocolError(MALFORMED, "frames must be a sequence") from None
    if len(items) < 2:
        raise ProtocolError(MALFORMED, f"need at least 2 frames, got {len(items)}")
    if len(items) > max_frames:
        raise ProtocolError(OVERSIZE, f"{len(items)} frames exceed {max_frames}")
    try:
        views = [memoryview(f) for f in items]
        return [v if v.ndim == 1 and v.itemsize == 1 else v.cast("B") for v in views]
    except TypeError:
        raise ProtocolError(MALFORMED, "frames must be bytes-like") from None


def decode_header(frame: Any, *, max_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> Header:
    """Validate and parse a header frame alone (auth reads t_ns and id before the body)."""
    try:
        view = memoryview(frame)
    except TypeError:
        raise ProtocolError(MALFORMED, "header must be bytes-like") from None
    if view.nbytes > max_bytes:
        raise ProtocolError(OVERSIZE, f"header of {view.nbytes} bytes exceeds {max_bytes}")
    h = _unpack(view, max_len=max_bytes, max_map=16, max_array=16)
    if type(h) is not dict:
        raise ProtocolError(MALFORMED, "header is not a map")
    msg_id = h.get("id") if type(h.get("id")) is str and len(h["id"]) <= MAX_ID_LEN else None
    if type(h.get("v")) is not int:
        raise ProtocolError(MALFORMED, "header has no int version", msg_id=msg_id)
    if h["v"] != PROTOCOL_VERSION:
        raise ProtocolError(BAD_VERSION, f"protocol {h['v']}, expected {PROTOCOL_VERSION}", msg_id=msg_id)
    if set(h) != _HEADER_KEYS:
        raise ProtocolError(MALFORMED, "header keys differ from " + ",".join(sorted(_HEADER_KEYS)),
                            msg_id=msg_id)
    ok = (msg_id and type(h["type"]) is str and 0 < len(h["type"]) <= MAX_TAG_LEN
          and type(h["session"]) is str and len(h["session"]) <= MAX_SESSION_LEN
          and (h["reply_to"] is None or (type(h["reply_to"]) is str and len(h["reply_to"]) <= MAX_ID_LEN))
          and type(h["t_ns"]) is int)
    if not ok:
        raise ProtocolError(MALFORMED, "header field of the wrong type or size", msg_id=msg_id)
    return Header(v=h["v"], type=h["type"], id=h["id"], session=h["session"],
                  reply_to=h["reply_to"], t_ns=h["t_ns"])


def peek_id(header_frame: Any) -> str | None:
    """The id in a header, or None: lets a refusal be addressed to the message it refuses."""
    try:
        return decode_header(header_frame).id
    except ProtocolError:
        return None


class _Buffers:
    """The buffer frames of one message, each to be referenced exactly once."""

    def __init__(self, views: list[memoryview], max_bytes: int) -> None:
        self.views = views
        self.used = [False] * len(views)
        self.max_bytes = max_bytes

    def take(self, wire: Any, path: str) -> np.ndarray:
        if type(wire) is not dict or set(wire) != _FRAME_KEYS:
            raise ProtocolError(MALFORMED, f"{path}: expected an array descriptor")
        i = wire["__frame__"]
        if type(i) is not int or not 0 <= i < len(self.views) or self.used[i]:
            raise ProtocolError(MALFORMED, f"{path}: bad or reused frame index")
        self.used[i] = True
        desc = arrays.parse_desc(wire["dtype"], wire["shape"], max_bytes=self.max_bytes)
        return arrays.from_frame(desc, self.views[i], max_bytes=self.max_bytes)


def _bad(path: str, spec: Spec, w: Any) -> ProtocolError:
    return ProtocolError(MALFORMED, f"{path}: expected {spec.kind}, got {type(w).__name__}")


_SCALAR_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bytes": bytes, "bool": bool}


def _from_wire(spec: Spec, w: Any, bufs: _Buffers, path: str) -> Any:
    k = spec.kind
    if k in _SCALAR_TYPES:
        if type(w) is _SCALAR_TYPES[k]:
            return w
        if k == "float" and type(w) is int:  # other msgpack writers may pack 1.0 as 1
            return float(w)
        raise _bad(path, spec, w)
    if k == "none" or (k == "optional" and w is None):
        if w is not None:
            raise _bad(path, spec, w)
        return None
    if k == "optional":
        return _from_wire(spec.args[0], w, bufs, path)
    if k == "union":
        for a in spec.args:
            if type(w) is _SCALAR_TYPES[a.kind]:
                return w
        if type(w) is int and any(a.kind == "float" for a in spec.args):
            return float(w)
        raise _bad(path, spec, w)
    if k in ("list", "vartuple", "tuple"):
        if type(w) is not list or (k == "tuple" and len(w) != len(spec.args)):
            raise _bad(path, spec, w)
        args = spec.args if k == "tuple" else spec.args * len(w)
        items = [_from_wire(a, x, bufs, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, w))]
        return items if k == "list" else tuple(items)
    if k == "dict":
        if type(w) is not dict or not all(type(key) is str for key in w):
            raise _bad(path, spec, w)
        return {key: _from_wire(spec.args[0], x, bufs, f"{path}[{key!r}]") for key, x in w.items()}
    if k == "array":
        return bufs.take(w, path)
    if k == "struct":
        return _struct_from_wire(spec, w, bufs, path)
    raise AssertionError(f"unhandled spec kind {k}")


def _struct_from_wire(spec: Spec, w: Any, bufs: _Buffers, path: str) -> Any:
    if type(w) is not dict:
        raise _bad(path, spec, w)
    if set(w) != set(spec.names):
        missing = sorted(set(spec.names) - set(w))
        extra = sorted(repr(key)[:40] for key in set(w) - set(spec.names))[:5]
        raise ProtocolError(MALFORMED, f"{path}: missing fields {missing}, unexpected {extra}")
    kwargs = {n: _from_wire(a, w[n], bufs, f"{path}.{n}") for n, a in zip(spec.names, spec.args)}
    try:
        return spec.cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a class's own __post_init__ checks
        raise ProtocolError(MALFORMED, f"{path}: {exc}"[:200]) from None


def decode(frames: Sequence[Any], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
           max_frames: int = DEFAULT_MAX_FRAMES, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
           max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> Envelope:
    """`[header, body, *buffers]` (any bytes-like objects) -> Envelope; ProtocolError otherwise.

    Arrays in the result are read-only views on the given buffers (no copy).
    """
    views = _views(frames, max_frames)
    header = decode_header(views[0], max_bytes=max_header_bytes)
    try:
        cls = message_class(header.type)
        body_view, buf_views = views[1], views[2:]
        if body_view.nbytes > max_body_bytes:
            raise ProtocolError(OVERSIZE, f"body of {body_view.nbytes} bytes exceeds {max_body_bytes}")
        for b in buf_views:
            if b.nbytes > max_frame_bytes:
                raise ProtocolError(OVERSIZE, f"frame of {b.nbytes} bytes exceeds {max_frame_bytes}")
        body = _unpack(body_view, max_len=max_body_bytes, max_map=MAX_MAP_LEN, max_array=max_body_bytes)
        bufs = _Buffers(buf_views, max_frame_bytes)
        msg = _struct_from_wire(schema(cls), body, bufs, header.type)
        if not all(bufs.used):
            raise ProtocolError(MALFORMED, f"{bufs.used.count(False)} buffer frames not referenced")
    except ProtocolError as exc:
        exc.msg_id = exc.msg_id or header.id
        raise
    return Envelope(header, msg, sum(v.nbytes for v in views))


# --- error replies ---------------------------------------------------------------------------


def error_reply(exc: ProtocolError) -> ErrorReply:
    return ErrorReply(code=exc.code, message=exc.message[:1000])


def encode_error(exc: ProtocolError, *, request: Header | None = None) -> Frames:
    """The frames of an ErrorReply addressed to the failed request (by its header, or the id
    the error recovered from a header that could be read)."""
    reply_to = request.id if request is not None else exc.msg_id
    return encode(error_reply(exc), reply_to=reply_to, session=request.session if request else "")

