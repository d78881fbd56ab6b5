"""Memory admission: refuse a model that will not fit BEFORE loading it, with the numbers.

A model that does not fit does not fail cleanly (macOS swaps until the machine is unusable,
Linux's OOM killer strikes minutes later), so the agent estimates its footprint from what is
on disk and compares it with the memory free now, keeping a reserve. `estimate_bytes` and
`decide` are pure; `footprint` reads file sizes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_OVERHEAD = 1.25  # KV cache, activations, allocator slack over the weights themselves
DEFAULT_RESERVE_BYTES = 512 * 2**20  # left for the OS and everything else on the Mac
GGUF_QUANT_BITS = 4.5  # Q4_x: 4-bit values + a scale (and bias) per 32-value group
DENSE_BITS = 32  # dequantized weights on Linux CPU stay float32 (docs/design.md, Linux CPU)
TINY_BYTES = 4 * 2**20  # a tiny random model: a few hundred thousand float32 params
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


class AdmissionError(RuntimeError):
    """The model would not fit in this machine's free memory; the message has the numbers."""


@dataclass(frozen=True)
class Admission:
    ok: bool
    need_bytes: int
    free_bytes: int
    reserve_bytes: int
    reason: str


def estimate_bytes(file_bytes: int, *, expand: float = 1.0,
                   overhead: float = DEFAULT_OVERHEAD) -> int:
    """Resident bytes of a model whose weights take `file_bytes` on disk; `expand` > 1 when
    the loader dequantizes (a 4.5-bit GGUF loaded dense as float32: 32 / 4.5)."""
    if file_bytes < 0 or expand <= 0 or overhead < 1:
        raise ValueError(f"bad estimate inputs: {file_bytes=}, {expand=}, {overhead=}")
    return int(file_bytes * expand * overhead)


def decide(spec: str, need_bytes: int | None, free_bytes: int,
           reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> Admission:
    """Admit when need + reserve <= free. Unknown need (a remote id) or unknown free memory
    (0: the platform would not say) admits, since refusing would block a model that fits."""
    if need_bytes is None or free_bytes <= 0:
        return Admission(True, need_bytes or 0, free_bytes, reserve_bytes,
                         f"'{spec}': size or free memory unknown; admitted unchecked")
    ok = need_bytes + reserve_bytes <= free_bytes
    verdict = "fits" if ok else "does not fit"
    reason = (f"model '{spec}' needs about {_gib(need_bytes)} (+ {_gib(reserve_bytes)} reserve); "
              f"{_gib(free_bytes)} is free: {verdict}")
    return Admission(ok, need_bytes, free_bytes, reserve_bytes, reason)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _weights_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*")
               if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def footprint(spec: str) -> int | None:
    """Estimated resident bytes for a model spec without loading it; None when unknown
    (a Hugging Face id that is not on disk)."""
    from macfleet.engine.models import default_dense, embedded_model_path

    name, _, opt = spec.partition(":")
    if name == "tiny":
        return TINY_BYTES
    if name == "smollm2":
        path = embedded_model_path()
        dense = (opt == "dense") if opt in ("dense", "q") else default_dense()
    else:
        path = Path(spec).expanduser()
        dense = default_dense()
        if not path.exists():
            return None
    if path is None:
        return None
    gguf = path.suffix == ".gguf"
    return estimate_bytes(_weights_bytes(path),
                          expand=DENSE_BITS / GGUF_QUANT_BITS if gguf and dense else 1.0)


def admit(spec: str, free_bytes: int, *, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> Admission:
    """Raise AdmissionError when `spec` will not fit in `free_bytes`; else the admission."""
    a = decide(spec, footprint(spec), free_bytes, reserve_bytes)
    if not a.ok:
        raise AdmissionError(a.reason + "; free memory or pick a smaller/quantized model")
    return a
