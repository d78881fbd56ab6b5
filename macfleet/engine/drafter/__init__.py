"""Moved (issue 34): this package held both what drafts while a user waits and the offline data
factory that trains a drafter. They now live apart:

    macfleet/engine/proposers/eagle/   the EAGLE head, its feature taps, chain and tree drafting,
                                       the F3 int8 codec
    macfleet/engine/proposers/         choice.py (`auto`), shipped.py + weights/ (what ships)
    macfleet/engine/tree_budget.py     the verify-curve tree-size budget (EAGLE-2, retrieval)
    macfleet/distill/                  prompts and questions, answers, the dataset, training,
                                       the `macfleet distill` pipeline, the contamination check

An old import path a script may hold (`from macfleet.engine.drafter.head import load_head`)
still works: `macfleet.engine.drafter.X` is an alias module whose names are read from X's new
home(s) (MOVED) when first asked for, with a DeprecationWarning that names them. Nothing is
imported before a name is asked for, so importing the engine never imports the training package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

_EAGLE = "macfleet.engine.proposers.eagle"
# old module -> its new home(s), searched in order for each name asked for
MOVED: dict[str, tuple[str, ...]] = {
    "head": (f"{_EAGLE}.head",),
    "features": (f"{_EAGLE}.features",),
    "proposer": (f"{_EAGLE}.chain", f"{_EAGLE}.load", "macfleet.engine.proposers.shipped"),
    "tree_draft": (f"{_EAGLE}.tree",),
    "f3codec": (f"{_EAGLE}.f3codec",),
    "choice": ("macfleet.engine.proposers.choice",),
    "budget": ("macfleet.engine.tree_budget",),
    "distill": ("macfleet.distill.pipeline", f"{_EAGLE}.head"),
    "batchgen": ("macfleet.distill.batchgen",),
    "chat_prompts": ("macfleet.distill.chat_prompts",),
    "contamination": ("macfleet.distill.contamination",),
    "contamination_sources": ("macfleet.distill.contamination_sources",),
    "data": ("macfleet.distill.data",),
    "dataset": ("macfleet.distill.dataset",),
    "prompts": ("macfleet.distill.prompts",),
    "self_instruct": ("macfleet.distill.self_instruct", "macfleet.distill.prompts"),
    "train": ("macfleet.distill.train",),
}


def _alias_getattr(old: str, homes: tuple[str, ...]):
    def __getattr__(name: str):
        for home in homes:
            value = getattr(importlib.import_module(home), name, _MISSING)
            if value is not _MISSING:
                return value
        raise AttributeError(f"{old} moved to {' / '.join(homes)}, which have no {name!r}")
    return __getattr__


_MISSING = object()


class _Alias(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a plain new module

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        homes = MOVED[old.rpartition(".")[2]]
        warnings.warn(f"{old} moved to {' / '.join(homes)}; import it from there",
                      DeprecationWarning, stacklevel=2)
        module.__doc__ = f"Moved: an alias of {', '.join(homes)}."
        module.__getattr__ = _alias_getattr(old, homes)
        module.__dir__ = lambda: sorted({n for h in homes
                                         for n in dir(importlib.import_module(h))})


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `macfleet.engine.drafter.X`: an alias for a moved module, a clear error for any
    other name."""

    def find_spec(self, fullname, path, target=None):
        pkg, _, name = fullname.rpartition(".")
        if pkg != __name__:
            return None
        if name not in MOVED:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: macfleet.engine.drafter moved (drafting to "
                f"macfleet.engine.proposers.eagle, training to macfleet.distill; see "
                f"{__name__}.MOVED)", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _Alias())


def __getattr__(name: str):
    if name in MOVED:  # `macfleet.engine.drafter.head` without importing it first
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
