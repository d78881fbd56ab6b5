"""JSON schema options of structured output (pure; no MLX): the whitespace the grammar allows,
and OpenAI's strict mode.

llguidance's JSON grammar allows any run of whitespace between tokens, and a small model spends
its token budget on it until max_tokens cuts the document; `with_json_options` allows only what
a compact or indented document has (a schema's own `x-guidance` replaces that whole).
`strict_schema` implies `additionalProperties: false` on every object, as OpenAI's strict mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# one gap: nothing, one space, or a newline and up to 16 spaces (eight levels of two, four of
# four; deeper documents stay valid, less indented)
JSON_WHITESPACE = r"( |\n {0,16})"
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
GUIDANCE = "x-guidance"


def with_json_options(schema: Mapping[str, Any]) -> dict:
    """`schema` with macfleet's JSON options, unless it names its own `x-guidance`."""
    return dict(schema) if GUIDANCE in schema else {**schema, GUIDANCE: dict(JSON_OPTIONS)}


class StrictSchemaError(ValueError):
    """A schema strict mode cannot take; `path` says where (JSON pointer)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(f"{message} (at '{path or '/'}')")
        self.path = path


_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_ONE = ("items", "not", "if", "then", "else", "contains", "additionalItems")


def _is_object(node: Mapping[str, Any]) -> bool:
    t = node.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or "properties" in node


def strict_schema(schema: Any, path: str = "") -> Any:
    """`schema` with `additionalProperties: false` on every object that does not say it; an
    object that allows other properties is refused (StrictSchemaError), as OpenAI's strict
    mode refuses it."""
    if isinstance(schema, list):
        return [strict_schema(s, f"{path}/{i}") for i, s in enumerate(schema)]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for k in _SUB_MAPS:
        if isinstance(out.get(k), Mapping):
            out[k] = {n: strict_schema(s, f"{path}/{k}/{n}") for n, s in out[k].items()}
    for k in _SUB_LISTS + _SUB_ONE:
        if k in out:
            out[k] = strict_schema(out[k], f"{path}/{k}")
    if _is_object(out):
        extra = out.get("additionalProperties", False)
        if extra is not False:
            raise StrictSchemaError("strict mode needs 'additionalProperties': false on every "
                                    "object (properties the schema does not name are refused)",
                                    f"{path}/additionalProperties")
        out["additionalProperties"] = False
    return out
