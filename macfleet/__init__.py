"""macfleet: speculative decoding across Macs.

mlx-lm's package `__init__` imports its converter, generator and loader, and with them
transformers and huggingface_hub: ~2 s of every process that imports a model class, measured
on a 2-core AMD EPYC (an agent, a server or a CLI command: importing the engine and loading
the tiny model took 2.6-2.9 s, 0.7 s without it). macfleet needs mlx-lm's model classes and
caches everywhere and its loader only for mlx-lm model directories, so the package is
registered here with its `__init__` run on the first look at any of its attributes
(`mlx_lm.load`, `from mlx_lm import generate`); a submodule imported by its dotted name
(`import mlx_lm.models.llama`, `from mlx_lm.generate import generate_step`) imports as it
always does, without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import types


class _DeferredPackage(types.ModuleType):
    """A package whose `__init__` has not run yet: it runs on the first look at an attribute
    that is not the import system's own (a dunder), at every such name, since one its
    `__init__` binds may be set already by a submodule of that name (`import mlx_lm.generate`
    sets `generate` to the module, its `__init__` rebinds it to the function). Then the
    package is a plain module again: later looks cost nothing extra."""

    _lock = threading.Lock()

    def __getattribute__(self, name: str):
        if not name.startswith("__") or name in ("__all__", "__version__"):
            with _DeferredPackage._lock:
                if type(self) is _DeferredPackage:  # (another thread may have run it)
                    self.__class__ = types.ModuleType  # the __init__'s own looks go plain
                    spec = types.ModuleType.__getattribute__(self, "__spec__")
                    spec.loader.exec_module(self)
        return types.ModuleType.__getattribute__(self, name)


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
    pkg.__class__ = _DeferredPackage
    sys.modules["mlx_lm"] = pkg


_defer_mlx_lm_init()
