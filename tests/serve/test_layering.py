"""DESIGN.md layering for the serving code: the engine side imports no networking, the
scheduler is a pure function module (no MLX), HTTP lives only in macfleet/serve/app.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NETWORK = ("starlette", "uvicorn", "httpx", "zmq", "bridge", "socket", "asyncio", "agents")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("rel,banned", [
    ("macfleet/engine/batch.py", NETWORK),
    ("macfleet/serve/engine.py", NETWORK),
    ("macfleet/serve/scheduler.py", (*NETWORK, "mlx", "numpy")),
    ("macfleet/serve/schemas.py", (*NETWORK, "mlx")),
    ("macfleet/serve/timing.py", (*NETWORK, "mlx", "numpy")),
    ("macfleet/fleet/batch.py", (*NETWORK, "mlx", "numpy", "http")),
])
def test_serving_layers(rel, banned):
    bad = {m for m in _imports(ROOT / rel) if m.split(".")[0] in banned}
    assert not bad, f"{rel} imports {sorted(bad)}"
