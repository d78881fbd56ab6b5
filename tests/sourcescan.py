"""The product's sources, parsed once per test process: the static checks (test_layering's
rules and circles, test_capabilities' probes, test_codec's error-code names) walk the same
~40,000 lines, and parsing them is most of what those tests cost."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agents", "bridge", "macfleet", "tui")


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a file (ast.walk's order); a product file's parse is kept for the
    process (the sources do not change during a run), any other file is parsed afresh."""
    path = path.resolve()
    if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
        return _product_nodes(path)
    return tuple(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


@functools.cache
def _product_nodes(path: Path) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))
