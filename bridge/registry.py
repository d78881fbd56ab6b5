"""The message registry: tag <-> class, and each class's fields compiled into a `Spec` tree.

`@message(tag)` (used by bridge/messages.py, where every message class lives) makes a class a
frozen dataclass, registers it and compiles its annotations at import time, so an unsupported
field type fails when the module loads, not when a peer sends it. The codec (bridge/codec.py)
walks those Spec trees to validate every field of every incoming message. `equal` and `example`
serve the tests: deep equality with ndarray fields, and a valid instance of any message built
from its schema. Import the classes and these functions from `bridge.messages`, which loads
the registrations.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from bridge.arrays import as_bfloat16
from bridge.errors import UNKNOWN_TYPE, ProtocolError

__all__ = ["Message", "Spec", "message", "registry", "message_class", "tag_of", "is_terminal",
           "schema", "equal", "example"]

T = TypeVar("T")
Message = Any  # an instance of a registered class

SCALARS: dict[type, str] = {int: "int", float: "float", str: "str", bool: "bool", bytes: "bytes"}


@dataclass(frozen=True)
class Spec:
    """A compiled field type.

    kind: int | float | str | bool | bytes | none | optional | union | list | vartuple | tuple |
    dict | array | struct. `args` are child specs (for struct: one per field, named by `names`).
    """

    kind: str
    args: tuple[Spec, ...] = ()
    names: tuple[str, ...] = ()
    cls: type | None = None


@dataclass(frozen=True)
class _Entry:
    cls: type
    spec: Spec
    terminal: bool


_BY_TAG: dict[str, _Entry] = {}
_BY_CLS: dict[type, str] = {}
_STRUCTS: dict[type, Spec] = {}
_COMPILING: set[type] = set()


def _compile(tp: Any, where: str) -> Spec:
    if tp in SCALARS:
        return Spec(SCALARS[tp])
    if tp is None or tp is type(None):
        return Spec("none")
    if tp is np.ndarray:
        return Spec("array")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is np.ndarray:  # np.typing.NDArray[...]
        return Spec("array")
    if origin in (types.UnionType, typing.Union):
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) < len(args):
            inner = _compile(rest[0] if len(rest) == 1 else typing.Union[rest], where)
            return Spec("optional", (inner,))
        if all(a in SCALARS for a in args):
            return Spec("union", tuple(Spec(SCALARS[a]) for a in args))
        raise TypeError(f"{where}: only X | None and unions of scalars are supported, not {tp}")
    if origin is list and len(args) == 1:
        return Spec("list", (_compile(args[0], where),))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return Spec("vartuple", (_compile(args[0], where),))
        if args and Ellipsis not in args:
            return Spec("tuple", tuple(_compile(a, where) for a in args))
    if origin is dict and len(args) == 2 and args[0] is str:
        return Spec("dict", (_compile(args[1], where),))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return schema(tp)
    raise TypeError(f"{where}: field type {tp!r} cannot travel")


def schema(cls: type) -> Spec:
    """The compiled Spec of a frozen dataclass (message or nested struct), cached."""
    cached = _STRUCTS.get(cls)
    if cached is not None:
        return cached
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")
    if cls in _COMPILING:
        raise TypeError(f"{cls.__name__} refers to itself; recursive messages are not supported")
    _COMPILING.add(cls)
    try:
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]
        names = tuple(f.name for f in fields)
        args = tuple(_compile(hints[n], f"{cls.__name__}.{n}") for n in names)
    finally:
        _COMPILING.discard(cls)
    spec = Spec("struct", args, names, cls)
    _STRUCTS[cls] = spec
    return spec


@typing.dataclass_transform(frozen_default=True)
def message(tag: str, *, terminal: bool = True) -> Callable[[type[T]], type[T]]:
    """Register a message class under `tag`.

    terminal: whether a reply of this type ends an exchange (`Client.stream` stops on it);
    streamed partial replies (chunks) say terminal=False.
    """
    if not isinstance(tag, str) or not tag:
        raise TypeError("a message tag is a non-empty str")

    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            cls = dataclass(frozen=True)(cls)
        if tag in _BY_TAG and _BY_TAG[tag].cls is not cls:
            raise ValueError(f"message tag {tag!r} already used by {_BY_TAG[tag].cls.__name__}")
        if cls in _BY_CLS and _BY_CLS[cls] != tag:
            raise ValueError(f"{cls.__name__} already registered as {_BY_CLS[cls]!r}")
        _BY_TAG[tag] = _Entry(cls, schema(cls), terminal)
        _BY_CLS[cls] = tag
        return cls

    return register


def registry() -> Mapping[str, type]:
    """tag -> class, read-only."""
    return MappingProxyType({tag: e.cls for tag, e in _BY_TAG.items()})


def message_class(tag: str) -> type:
    """The class registered under `tag`; ProtocolError(unknown_type) otherwise."""
    entry = _BY_TAG.get(tag)
    if entry is None:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {tag!r}")
    return entry.cls


def tag_of(msg_or_cls: Any) -> str:
    """The tag of a registered message (instance or class); TypeError otherwise."""
    cls = msg_or_cls if isinstance(msg_or_cls, type) else type(msg_or_cls)
    tag = _BY_CLS.get(cls)
    if tag is None:
        raise TypeError(f"{cls.__name__} is not a registered message")
    return tag


def is_terminal(msg_or_cls: Any) -> bool:
    return _BY_TAG[tag_of(msg_or_cls)].terminal


def equal(a: Any, b: Any) -> bool:
    """Deep equality that also compares ndarray fields (dtype, shape, bytes)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(equal(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def example(cls: type, *, seed: int = 0, dtype: str = "float32", none: bool = False) -> Any:
    """A valid instance of a message (or nested struct) built from its schema.

    Lets tests round-trip every registered message, including ones added later, without a
    hand-written sample. none=True picks None for every optional field and empty containers.
    """
    def build(spec: Spec) -> Any:
        k = spec.kind
        values = {"int": -(seed * 7 + 1) if seed % 2 else seed * 7 + 1, "float": seed + 0.5,
                  "str": f"s{seed}-\u00e9", "bytes": bytes([seed % 256, 0, 255]),
                  "bool": seed % 2 == 0, "none": None}
        if k in values:
            return values[k]
        if k == "optional":
            return None if none else build(spec.args[0])
        if k == "union":
            return build(spec.args[seed % len(spec.args)])
        n = 0 if none else 2
        if k == "list":
            return [build(spec.args[0]) for _ in range(n)]
        if k == "vartuple":
            return tuple(build(spec.args[0]) for _ in range(n))
        if k == "tuple":
            return tuple(build(a) for a in spec.args)
        if k == "dict":
            return {f"k{i}": build(spec.args[0]) for i in range(n)}
        if k == "array":
            base = (np.arange(6) + seed % 100).reshape(2, 3)
            if dtype == "bfloat16":
                return as_bfloat16(base.astype(np.uint16))
            return base.astype(dtype)
        return spec.cls(**{n: build(a) for n, a in zip(spec.names, spec.args)})

    return build(schema(cls))
