"""macfleet: speculative decoding across Macs.

mlx-lm's package `__init__` imports its converter, generator and loader, and with them
transformers and huggingface_hub: ~2 s of every process that imports a model class, measured
on a 2-core AMD EPYC (an agent, a server or a CLI command: importing the engine and loading
the tiny model took 2.6-2.9 s, 0.7 s without it). macfleet needs mlx-lm's model classes and
caches everywhere and its loader only for mlx-lm model directories, so the package is
registered here with its `__init__` run on the first use of one of its own attributes
(`mlx_lm.load`, `from mlx_lm import generate`: PEP 562's module `__getattr__`); a submodule
(`mlx_lm.models.llama`, `mlx_lm.generate`) imports as it always does.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading


def _defer_mlx_lm_init() -> None:
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    # what the package's __init__ sets before transformers is imported (by our GGUF
    # tokenizer, say): without it transformers warns on stderr that PyTorch is missing
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    pkg = importlib.util.module_from_spec(spec)  # its __path__ and __spec__, not yet run
    lock = threading.Lock()
    ran = False

    def __getattr__(name: str):
        nonlocal ran
        if not name.startswith("__"):
            try:
                sub = importlib.util.find_spec(f"mlx_lm.{name}")
            except (ImportError, ValueError):
                sub = None
            if sub is not None:  # a submodule asked as an attribute (`from mlx_lm import x`)
                return importlib.import_module(f"mlx_lm.{name}")
        with lock:
            if ran:
                raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}")
            ran = True
            spec.loader.exec_module(pkg)  # the package's own __init__, in its namespace
        return getattr(pkg, name)

    pkg.__getattr__ = __getattr__
    sys.modules["mlx_lm"] = pkg


_defer_mlx_lm_init()
