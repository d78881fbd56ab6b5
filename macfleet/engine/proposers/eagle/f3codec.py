"""The F3 int8 codec: hidden states [n, H] as int8 with one scale per row, the KV codec's
(engine/kvship.py): half float16's bytes on the critical path."""

from __future__ import annotations

import numpy as np

from macfleet.engine.kvship import decode_int8 as _decode
from macfleet.engine.kvship import encode_int8

__all__ = ["decode_int8", "encode_int8"]


def decode_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return _decode(q, scales).astype(np.float16)
