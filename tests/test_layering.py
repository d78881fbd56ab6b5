"""The import layering of docs/design.md and docs/architecture.md, from one allowed-imports table.

Each source file is judged by the most specific entry of ALLOWED (a file, else its folder, else
its package): the project modules it may import (by prefix), and what else it may (`only`) or
must not (`banned`) import. The rows say, among others: `bridge` imports no other project package
but the plain records of macfleet/stats.py, and no pickle; `macfleet.engine` imports no
networking and nothing of the fleet, the CLI or the agents; topology is pure; the dashboard reads
only the fleet's records; benchmarks are imported by nothing but the CLI; the training package (macfleet/distill) only by the CLI and the benchmarks. And no
import circle anywhere: imports inside functions count too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from sourcescan import nodes

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
    # the standard library only: it defers mlx-lm's package __init__ (importing any part of
    # macfleet, the wire's records included, imports nothing heavy)
    "macfleet/__init__.py": Rule((), only=STDLIB),
    "macfleet/stats.py": Rule((), only=STDLIB),
    "macfleet/sysinfo.py": Rule((), banned=NETWORK),
    # progress bars / plain progress lines: a leaf any layer may report through
    "macfleet/progress.py": Rule((), only=(*STDLIB, "rich")),
    # `doctor`'s checks: host facts and where the embedded model is, nothing of the network
    "macfleet/doctor.py": Rule(("macfleet.sysinfo", "macfleet.engine.models"), banned=NETWORK),
    # first use fetches the embedded model: pip and urllib against the user's package index
    "macfleet/fetch.py": Rule(("macfleet.engine.cachedir", "macfleet.engine.models",
                               "macfleet.progress"), only=STDLIB),
    # MLX only, no networking
    "macfleet/engine": Rule(("macfleet.engine", "macfleet.progress", *RECORDS), banned=NETWORK),
    # the offline data factory that trains drafters: on top of the engine, no networking; only
    # the CLI and the benchmarks import it (test_the_data_factory_is_imported_only_from_above)
    "macfleet/distill": Rule(("macfleet.distill", "macfleet.engine", "macfleet.progress",
                              *RECORDS), banned=NETWORK),
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
    "macfleet/serve/scheduler.py": Rule(("macfleet.serve", "macfleet.engine.prefix"),
                                        banned=(*NETWORK, "mlx", "numpy")),
    "macfleet/serve/schemas.py": Rule(("macfleet.serve", "macfleet.engine", *RECORDS),
                                      banned=(*NETWORK, "mlx")),
    # measurements and the CLI sit on top of everything
    "macfleet/bench": Rule(PROJECT),
    # ... but the CLI never touches wire types: it reads macfleet.fleet's events and errors (the
    # `agent` command starts the daemon of agents/, `dash` the dashboard of tui/)
    "macfleet/cli": Rule(("macfleet", "agents", "tui")),
    "macfleet/__main__.py": Rule(("macfleet.cli",)),
    # the daemon: bridge + engine (+ the networking-free continuous batch the verifier runs,
    # with its records and events: logprobs, the prompt cache's reuse; one request through it
    # on the caller's thread, serve/one.py; the planner's pure placements it carries out:
    # disagg, MoE experts);
    # the tool plane's presets measure through the engine (engine/verify_costs.py), never bench/
    "agents": Rule(("agents", "bridge", "macfleet.engine", "macfleet.sysinfo",
                    "macfleet.topology.disagg", "macfleet.topology.moe", "macfleet.serve.engine",
                    "macfleet.serve.one", "macfleet.serve.logprobs", "macfleet.serve.prompt_cache",
                    "macfleet.fleet.batch", *RECORDS),
                   banned=("starlette", "uvicorn", "httpx", "textual")),
    # the dashboard observes the fleet's records (and computes as stats does); no sockets, no MLX
    "tui": Rule(("tui", "macfleet.fleet.snapshot", "macfleet.fleet.batch", *RECORDS),
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
    for node in nodes(path):
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
    """The rule of docs/design.md, spelled out: no zmq/zeroconf/starlette/uvicorn/bridge in the
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


def test_the_data_factory_is_imported_only_from_above():
    """macfleet/distill trains drafters offline: the CLI and the benchmarks use it; the engine,
    the agents, the server, the fleet client, the wire and the dashboard never import it (an
    import inside a function counts)."""
    above = ("macfleet/distill/", "macfleet/cli/", "macfleet/bench/")
    bad = {rel: sorted(n for n in _imports(ROOT / rel) if _allowed(n, ("macfleet.distill",)))
           for rel in _sources() if not rel.startswith(above)}
    assert not {rel: names for rel, names in bad.items() if names}
    for row in ("macfleet/engine", "agents", "macfleet/serve", "macfleet/fleet", "bridge", "tui"):
        assert not _allowed("macfleet.distill", ALLOWED[row].project), row


@pytest.mark.slow  # a process importing every serving-side module: seconds (the static twin
# above, test_the_data_factory_is_imported_only_from_above, stays in the fast lane)
def test_importing_the_serving_side_loads_no_training_code():
    """At run time too: importing every module of the engine, the agents, the server and the
    dashboard loads no macfleet.distill."""
    mods = [_module(rel) for rel in _sources()
            if rel.startswith(("macfleet/engine/", "macfleet/serve/", "agents/", "tui/"))]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('macfleet.distill')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


# --- import circles ---------------------------------------------------------------------------


def _module(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Project module -> the project modules it imports, at module level or inside a function
    (a function-level import is still a circle, only a deferred one). `from pkg import name`
    points at pkg.name when that is a module, else at pkg; a name that is no module points at
    the nearest enclosing one."""
    files = {_module(str(p.relative_to(root))): p for pkg in PROJECT
             for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out: set[str] = set()
        for node in nodes(path):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` folders up
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names]
            else:
                continue
            out |= {t for t in map(known, names) if t and t != mod}
        graph[mod] = out
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, g) for g in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest circle through the group's first module (breadth first, inside the group)."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in {group}")


def test_no_import_circles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_circle_finder_finds_module_and_function_level_circles(tmp_path):
    """The check above can fail: a circle closed by an import inside a function, a
    `from pkg import module` and a relative import are all found, and a chain is not one."""
    pkg = tmp_path / "macfleet" / "demo"
    pkg.mkdir(parents=True)
    (tmp_path / "macfleet" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from macfleet.demo.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from macfleet.demo import c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("import macfleet.demo.a\n")
    for top in ("bridge", "agents", "tui"):
        (tmp_path / top).mkdir()
    graph = import_graph(tmp_path)
    assert graph["macfleet.demo.c"] == {"macfleet.demo.a"}
    assert import_cycles(graph) == [["macfleet.demo.a", "macfleet.demo.b", "macfleet.demo.c",
                                     "macfleet.demo.a"]]
    (pkg / "c.py").write_text("import json\n")  # a -> b -> c, d -> a: chains only
    assert import_cycles(import_graph(tmp_path)) == []


@pytest.mark.slow  # a fresh interpreter (~3 s)
def test_the_engine_and_a_model_class_load_without_mlx_lms_loader():
    """macfleet/__init__.py defers mlx-lm's package __init__ (its loader and converter bring
    transformers and huggingface_hub: ~2 s of every agent, server and CLI process): the engine,
    the agent daemon and the tiny model load without them, and `mlx_lm.load` still works, as
    does its `generate` function after the submodule of that name was imported."""
    code = ("import sys; from macfleet.engine.models import load_model; "
            "import macfleet.serve.engine, agents.daemon; load_model('tiny:1:64'); "
            "print(sorted(m for m in ('transformers', 'huggingface_hub', 'mlx_lm.utils') "
            "if m in sys.modules)); import mlx_lm, mlx_lm.generate; from mlx_lm import generate; "
            "print(callable(mlx_lm.load), callable(generate), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout.splitlines() == ["[]", "True True True"], out.stdout + out.stderr
