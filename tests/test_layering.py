"""The import layering of DESIGN.md and docs/architecture.md, from one allowed-imports table.

Each source file is judged by the most specific entry of ALLOWED (a file, else its folder, else
its package): the project modules it may import (by prefix), and what else it may (`only`) or
must not (`banned`) import. The rows say, among others: `bridge` imports no other project package
but the plain records of macfleet/stats.py, and no pickle; `macfleet.engine` imports no
networking and nothing of the fleet, the CLI or the agents; topology is pure; the dashboard reads
only the fleet's records; benchmarks are imported by nothing but the CLI (and the agents' tool
plane).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("bridge", "agents", "tui", "macfleet")
STDLIB = tuple(sorted(sys.stdlib_module_names | {"__future__"}))
NETWORK = ("zmq", "zeroconf", "starlette", "uvicorn", "httpx", "socket", "asyncio", "http")
PICKLE = ("pickle", "cPickle", "dill", "cloudpickle")
# project modules with no layer of their own: plain records and host facts
RECORDS = ("macfleet.stats",)


@dataclass(frozen=True)
class Rule:
    project: tuple[str, ...]  # project modules it may import (module-name prefixes)
    banned: tuple[str, ...] = ()  # other top-level modules it must not import
    only: tuple[str, ...] | None = None  # when set: the only other top-level modules allowed


ALLOWED: dict[str, Rule] = {
    # the wire: nothing of the project but plain records; no pickle on the wire
    "bridge": Rule(("bridge", *RECORDS), banned=PICKLE,
                   only=(*STDLIB, "numpy", "msgpack", "zmq", "zeroconf")),
    "macfleet/__init__.py": Rule((), only=()),
    "macfleet/stats.py": Rule((), only=STDLIB),
    "macfleet/sysinfo.py": Rule((), banned=NETWORK),
    # progress bars / plain progress lines: a leaf any layer may report through
    "macfleet/progress.py": Rule((), only=(*STDLIB, "rich")),
    # `doctor`'s checks: host facts and where the embedded model is, nothing of the network
    "macfleet/doctor.py": Rule(("macfleet.sysinfo", "macfleet.engine.models"), banned=NETWORK),
    # MLX only, no networking
    "macfleet/engine": Rule(("macfleet.engine", "macfleet.progress", *RECORDS), banned=NETWORK),
    # pure planning
    "macfleet/topology": Rule(("macfleet.topology",),
                              only=("__future__", "collections", "dataclasses", "typing")),
    # ... but for the planning inputs it reads from disk (results/, a model's config.json)
    "macfleet/topology/inputs.py": Rule(("macfleet.topology",),
                                        only=("__future__", "collections", "dataclasses",
                                              "typing", "json", "pathlib")),
    # the control-plane client: the wire, its own records, the engine's draft-length limits
    "macfleet/fleet": Rule(("bridge", "macfleet.fleet", "macfleet.engine.controller", *RECORDS),
                           banned=("mlx", "textual")),
    # what observers read: pure records (the dashboard imports only these)
    "macfleet/fleet/snapshot.py": Rule(("macfleet.fleet.snapshot", "macfleet.fleet.batch"),
                                       banned=(*NETWORK, "textual", "mlx")),
    "macfleet/fleet/batch.py": Rule(RECORDS, banned=(*NETWORK, "textual", "mlx")),
    # the server: HTTP only in app.py; the batching engine and scheduler are networking-free
    "macfleet/serve": Rule(("macfleet.serve", "macfleet.engine", "macfleet.fleet", "bridge",
                            *RECORDS)),
    "macfleet/serve/engine.py": Rule(("macfleet.serve", "macfleet.engine",
                                      "macfleet.fleet.batch", *RECORDS), banned=NETWORK),
    # ... and so are the parts it is made of (the verifier agent runs them too)
    **{f"macfleet/serve/{part}.py": Rule(("macfleet.serve", "macfleet.engine",
                                          "macfleet.fleet.batch", *RECORDS), banned=NETWORK)
       for part in ("batch_session", "costs", "decode", "drafting", "lifecycle", "session_kv")},
    "macfleet/serve/scheduler.py": Rule(("macfleet.serve",), banned=(*NETWORK, "mlx", "numpy")),
    "macfleet/serve/schemas.py": Rule(("macfleet.serve", "macfleet.engine", *RECORDS),
                                      banned=(*NETWORK, "mlx")),
    # measurements and the CLI sit on top of everything
    "macfleet/bench": Rule(PROJECT),
    # ... but the CLI never touches wire types: it reads macfleet.fleet's events and errors (the
    # `agent` command starts the daemon of agents/, `dash` the dashboard of tui/)
    "macfleet/cli": Rule(("macfleet", "agents", "tui")),
    "macfleet/__main__.py": Rule(("macfleet.cli",)),
    # the daemon: bridge + engine (+ the networking-free continuous batch the verifier runs,
    # with its records; the planner's pure placements it carries out: disagg, MoE experts);
    # the tool plane runs allowlisted benchmarks
    "agents": Rule(("agents", "bridge", "macfleet.engine", "macfleet.sysinfo",
                    "macfleet.topology.disagg", "macfleet.topology.moe", "macfleet.serve.engine",
                    "macfleet.fleet.batch", *RECORDS),
                   banned=("starlette", "uvicorn", "httpx", "textual")),
    "agents/presets.py": Rule(("agents", "bridge", "macfleet.engine", "macfleet.sysinfo",
                               "macfleet.bench", *RECORDS)),
    # the dashboard observes the fleet's records; no sockets, no MLX
    "tui": Rule(("tui", "macfleet.fleet.snapshot", "macfleet.fleet.batch"),
                banned=("zmq", "mlx", "zeroconf", "socket")),
}


def _rule(rel: str) -> Rule:
    parts = rel.removesuffix(".py").split("/")
    for n in range(len(parts), 0, -1):
        key = "/".join(parts[:n]) + (".py" if n == len(parts) else "")
        if key in ALLOWED:
            return ALLOWED[key]
    raise AssertionError(f"{rel}: no row of ALLOWED covers it")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module in PROJECT:  # `from macfleet import sysinfo` -> macfleet.sysinfo
                out |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out


def _sources() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PROJECT for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("rel", _sources())
def test_imports_follow_the_layering(rel):
    rule = _rule(rel)
    bad = []
    for name in sorted(_imports(ROOT / rel)):
        top = name.split(".")[0]
        if top in PROJECT:
            if not _allowed(name, rule.project):
                bad.append(name)
        elif top in rule.banned or (rule.only is not None and top not in rule.only):
            bad.append(name)
    assert not bad, f"{rel} imports {bad}"


def test_engine_imports_no_networking_and_no_upper_layer():
    """The rule of DESIGN.md, spelled out: no zmq/zeroconf/starlette/uvicorn/bridge in the
    engine (the table above says so for every engine file; this names it)."""
    rule = ALLOWED["macfleet/engine"]
    for banned in ("zmq", "zeroconf", "starlette", "uvicorn"):
        assert banned in rule.banned
    assert not any(_allowed(m, rule.project) for m in ("bridge", "agents", "macfleet.fleet",
                                                      "macfleet.cli", "macfleet.serve"))
    assert all(_rule(rel) is rule for rel in _sources() if rel.startswith("macfleet/engine/"))


def test_the_cli_never_imports_the_wire():
    rule = ALLOWED["macfleet/cli"]
    assert not _allowed("bridge", rule.project) and not _allowed("bridge.messages", rule.project)
    assert all(_rule(rel) is rule for rel in _sources() if rel.startswith("macfleet/cli/"))


def test_every_source_file_has_a_row():
    assert all(_rule(rel) for rel in _sources())
