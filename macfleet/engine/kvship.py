"""A prompt's KV cache as numpy slices, and back: what a prefill agent ships once to a verifier.

Prefill is compute-bound, decode bandwidth-bound, so a prefill agent computes a long prompt's KV
and ships it, and the verifier's compute thread never spends a whole prefill. Here (no
networking): cut a cache into bounded slices, encode them (`auto`: the cache's dtype, bit-exact;
`float16`; `int8`, one scale per head per position), check on the other side that they cover
every layer and position once (`KVAssembler`), and install the result into an empty cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from macfleet.engine.batch_kv import ShippedKV

KV_CODECS = ("auto", "float16", "int8")
DEFAULT_KV_CODEC = "auto"
DEFAULT_MAX_SLICE_BYTES = 4 * 1024 * 1024  # one message's K+V payload


class KVShipError(ValueError):
    """Slices that do not form the promised cache (shape, dtype, gap, overlap, count)."""


@dataclass(frozen=True)
class KVLayout:
    """What every layer's cache looks like: [heads, tokens, head_dim] in `dtype`."""

    layers: int
    heads: int
    head_dim: int
    dtype: str  # the cache's own dtype name: float32 | float16 | bfloat16

    def bytes_per_token(self, codec: str) -> int:
        """Wire bytes of one token's K and V over every layer (the planner's KV price)."""
        per_row = {"int8": self.head_dim + 2, "float16": 2 * self.head_dim}.get(
            codec, _itemsize(self.dtype) * self.head_dim)
        if codec == "auto" and self.dtype == "bfloat16":
            per_row = 4 * self.head_dim  # travels as float32 (exact)
        return 2 * self.layers * self.heads * per_row


@dataclass(frozen=True)
class KVSlice:
    """Layers [layer, layer + n_layers) at positions [start, start + n): K and V as sent,
    [n_layers, heads, n, head_dim]; int8 with float16 scales [n_layers, heads, n]."""

    layer: int
    start: int
    keys: np.ndarray
    values: np.ndarray
    keys_scale: np.ndarray | None = None
    values_scale: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.keys_scale, self.values_scale) if a is not None)
        return int(self.keys.nbytes + self.values.nbytes + extra)


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def layout_of(cache: Sequence) -> KVLayout:
    k = cache[0].keys
    if k is None:
        raise KVShipError("the cache is empty")
    return KVLayout(len(cache), int(k.shape[1]), int(k.shape[3]), _dtype_name(k))


def model_layout(model) -> KVLayout:
    """The layout of `model`'s KV cache, read off a one-token forward on a scratch cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)
    mx.eval([c.keys for c in cache])
    return layout_of(cache)


def encode_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] -> (q int8 [..., D], scales float16 [...]); symmetric, one scale per row."""
    x = np.asarray(x, dtype=np.float32)
    s = (np.abs(x).max(axis=-1) / 127.0).astype(np.float16)
    s = np.where(s > 0, s, np.float16(1.0))
    q = np.clip(np.rint(x / s.astype(np.float32)[..., None]), -127, 127).astype(np.int8)
    return q, s


def decode_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scales.astype(np.float32)[..., None]


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)  # bfloat16 is a subset of float32: exact
    return np.array(a)


def _encode(x: mx.array, codec: str) -> tuple[np.ndarray, np.ndarray | None]:
    if codec == "int8":
        return encode_int8(_to_numpy(x))
    if codec == "float16":
        return np.array(x.astype(mx.float16)), None
    if codec == "auto":
        return _to_numpy(x), None
    raise KVShipError(f"unknown KV codec '{codec}' (use {', '.join(KV_CODECS)})")


def export_slices(cache: Sequence, start: int, end: int, codec: str = DEFAULT_KV_CODEC,
                  max_bytes: int = DEFAULT_MAX_SLICE_BYTES) -> Iterator[KVSlice]:
    """Positions [start, end) of every layer, as slices of whole layers under max_bytes each
    (at least one layer per slice)."""
    if not 0 <= start <= end <= int(cache[0].offset):
        raise KVShipError(f"positions {start}..{end} outside the cache's {cache[0].offset}")
    lay = layout_of(cache)
    per_layer = max(1, (end - start) * lay.bytes_per_token(codec) // lay.layers)
    group = max(1, min(lay.layers, max_bytes // per_layer))
    for l0 in range(0, lay.layers, group):
        ks = mx.stack([c.keys[0, :, start:end, :] for c in cache[l0:l0 + group]])
        vs = mx.stack([c.values[0, :, start:end, :] for c in cache[l0:l0 + group]])
        mx.eval(ks, vs)
        (k, k_s), (v, v_s) = _encode(ks, codec), _encode(vs, codec)
        yield KVSlice(l0, start, k, v, k_s, v_s)


def _decode(data: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    return decode_int8(data, scale) if scale is not None else data


class KVAssembler:
    """Collects slices for `tokens` positions of `layout`; `complete` once every (layer,
    position) arrived exactly once. Refuses anything else with KVShipError."""

    def __init__(self, layout: KVLayout, tokens: int) -> None:
        self.layout, self.tokens = layout, tokens
        self._k = [np.zeros((layout.heads, tokens, layout.head_dim), np.float32)
                   for _ in range(layout.layers)]
        self._v = [np.zeros_like(a) for a in self._k]
        self._seen = np.zeros((layout.layers, tokens), dtype=bool)
        self.nbytes = 0

    @property
    def complete(self) -> bool:
        return bool(self._seen.all())

    def add(self, s: KVSlice) -> None:
        lay = self.layout
        if s.keys.shape != s.values.shape or s.keys.ndim != 4:
            raise KVShipError(f"slice K {s.keys.shape} and V {s.values.shape} differ")
        n_layers, heads, n, dim = s.keys.shape
        if (heads, dim) != (lay.heads, lay.head_dim):
            raise KVShipError(f"slice heads x dim {heads}x{dim}, cache {lay.heads}x{lay.head_dim}")
        if not (0 <= s.layer and s.layer + n_layers <= lay.layers and 0 <= s.start
                and s.start + n <= self.tokens):
            raise KVShipError(f"slice layers {s.layer}+{n_layers} at {s.start}+{n} out of range")
        int8 = s.keys.dtype == np.int8
        if int8 != (s.keys_scale is not None) or int8 != (s.values_scale is not None) or (
                int8 and (s.keys_scale.shape != s.keys.shape[:3]
                          or s.values_scale.shape != s.keys.shape[:3])):
            raise KVShipError("int8 slices need scales of shape [layers, heads, tokens]")
        if s.keys.dtype not in (np.int8, np.float16, np.float32):
            raise KVShipError(f"slice dtype {s.keys.dtype} is not a KV codec's")
        seen = self._seen[s.layer:s.layer + n_layers, s.start:s.start + n]
        if seen.any():
            raise KVShipError(f"slice layers {s.layer}+{n_layers} at {s.start}+{n} overlaps")
        k, v = _decode(s.keys, s.keys_scale), _decode(s.values, s.values_scale)
        for i in range(n_layers):
            self._k[s.layer + i][:, s.start:s.start + n] = k[i]
            self._v[s.layer + i][:, s.start:s.start + n] = v[i]
        seen[:] = True
        self.nbytes += s.nbytes

    def arrays(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer (keys, values) [heads, tokens, head_dim] float32; KVShipError if a gap."""
        if not self.complete:
            missing = int((~self._seen).sum())
            raise KVShipError(f"{missing} (layer, position) entries never arrived")
        return list(zip(self._k, self._v))


def install(cache: Sequence, layout: KVLayout, shipped_kv: ShippedKV) -> None:
    """Put received per-layer K/V into an empty cache, allocated as a chunked local prefill
    would leave it (a multiple of the cache's step), in the cache's own dtype."""
    if len(shipped_kv) != len(cache):
        raise KVShipError(f"{len(shipped_kv)} layers received, the model has {len(cache)}")
    dtype = getattr(mx, layout.dtype)
    for c, (k, v) in zip(cache, shipped_kv):
        n = k.shape[1]
        cap = -(-n // c.step) * c.step
        pad = ((0, 0), (0, 0), (0, cap - n), (0, 0))
        c.keys = mx.array(np.pad(k[None], pad)).astype(dtype)
        c.values = mx.array(np.pad(v[None], pad)).astype(dtype)
        c.offset = n
    mx.eval([c.keys for c in cache] + [c.values for c in cache])

