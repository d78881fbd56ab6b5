"""numpy arrays <-> (`{dtype, shape}` descriptor, raw buffer frame).

Arrays (draft probabilities, hidden states) are the bulk of flows F2 and F3. Re-encoding them
inside msgpack would copy and inflate them, so the body carries only a small descriptor and the
bytes travel as their own ZeroMQ frame; decoding is `np.frombuffer` on that frame (zero-copy, so
decoded arrays are read-only views that keep the received frame alive).

The wire byte order is little-endian. Only an allowlist of dtypes is accepted, and every
descriptor from a peer is checked against the frame it describes before numpy sees it.

bfloat16: numpy has no bfloat16, so such arrays are carried as their raw 16-bit patterns in a
`uint16` array whose dtype carries a metadata tag (`BFLOAT16`). `as_bfloat16(bits)` tags a uint16
array, `is_bfloat16(arr)` tests the tag; decoding a "bfloat16" frame returns a tagged uint16
array. An MLX user converts with `np.array(x.view(mx.uint16))` before sending and
`mx.array(bits).view(mx.bfloat16)` after receiving. A numpy dtype named "bfloat16" (ml_dtypes)
is also accepted on encode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from bridge.errors import BAD_DTYPE, BAD_SHAPE, OVERSIZE, ProtocolError

DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024  # one buffer frame; ~64 MB is a long-prompt F3
MAX_RANK = 8
MAX_DIM = 2**40

BFLOAT16_NAME = "bfloat16"
BFLOAT16 = np.dtype("<u2", metadata={"macfleet": BFLOAT16_NAME})

_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint32": np.dtype("<u4"),
    "uint8": np.dtype("u1"),
    "int8": np.dtype("i1"),
    BFLOAT16_NAME: BFLOAT16,
}
ALLOWED_DTYPES = frozenset(_DTYPES)


@dataclass(frozen=True)
class ArrayDesc:
    """What the body says about one buffer frame."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def as_bfloat16(bits: np.ndarray) -> np.ndarray:
    """Tag a uint16 array of bfloat16 bit patterns so it travels as "bfloat16" (a view, no copy)."""
    if bits.dtype != np.uint16:
        raise TypeError(f"bfloat16 bits must be uint16, got {bits.dtype}")
    return bits.view(BFLOAT16)


def is_bfloat16(arr: np.ndarray) -> bool:
    """True for arrays tagged by `as_bfloat16` (or decoded from a "bfloat16" frame)."""
    meta = arr.dtype.metadata
    return bool(meta) and meta.get("macfleet") == BFLOAT16_NAME


def dtype_name(arr: np.ndarray) -> str:
    """The wire name of an array's dtype; TypeError when it is not allowlisted."""
    if is_bfloat16(arr) or (arr.dtype.name == BFLOAT16_NAME and arr.dtype.itemsize == 2):
        return BFLOAT16_NAME
    name = arr.dtype.name
    if name not in _DTYPES or name == BFLOAT16_NAME:
        raise TypeError(f"dtype {arr.dtype} cannot travel; allowed: {sorted(ALLOWED_DTYPES)}")
    return name


def to_frame(arr: np.ndarray) -> tuple[ArrayDesc, memoryview]:
    """Describe an array and expose its bytes as one flat frame.

    No copy when the array is already C-contiguous and little-endian. The frame aliases the
    array: do not write to the array until the message has been sent.
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"expected numpy.ndarray, got {type(arr).__name__}")
    name = dtype_name(arr)
    if name == BFLOAT16_NAME:
        arr = arr.view(np.uint16)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
    shape = tuple(int(d) for d in arr.shape)
    return ArrayDesc(name, shape), memoryview(arr.reshape(-1).view(np.uint8))


def parse_desc(dtype: Any, shape: Any, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ArrayDesc:
    """Validate an untrusted `{dtype, shape}` pair from a peer."""
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ProtocolError(BAD_DTYPE, f"dtype {dtype!r} not allowed")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_RANK:
        raise ProtocolError(BAD_SHAPE, f"shape must be a list of at most {MAX_RANK} ints")
    for d in shape:
        if type(d) is not int or d < 0 or d > MAX_DIM:
            raise ProtocolError(BAD_SHAPE, f"bad dimension {d!r} in shape")
    # Bound the shape even when a zero dimension makes the product 0: numpy refuses shapes whose
    # non-zero extent overflows, and a peer must not be able to make it raise.
    extent = math.prod(max(d, 1) for d in shape) * _DTYPES[dtype].itemsize
    if extent > max_bytes:
        raise ProtocolError(OVERSIZE, f"shape {shape} exceeds {max_bytes} bytes")
    return ArrayDesc(dtype, tuple(shape))


def from_frame(desc: ArrayDesc, frame: Any, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> np.ndarray:
    """A zero-copy, read-only array over `frame` (any buffer), checked against `desc`."""
    view = memoryview(frame)
    if view.nbytes > max_bytes:
        raise ProtocolError(OVERSIZE, f"frame of {view.nbytes} bytes exceeds {max_bytes}")
    if view.nbytes != desc.nbytes:
        raise ProtocolError(
            BAD_SHAPE, f"shape {desc.shape} of {desc.dtype} needs {desc.nbytes} bytes, frame has {view.nbytes}"
        )
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    arr = np.frombuffer(view, dtype=_DTYPES[desc.dtype]).reshape(desc.shape)
    arr.flags.writeable = False
    return arr
