"""Suite-wide: puts tests/ on sys.path so `tolerance` (shared float bounds) imports anywhere;
keeps measured tables and fleet keys out of the user's home; splits the run into the tests that
may share the machine and the `serial` ones (`--serial`, used by .ci/test; docs/testing.md)."""

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

# Measured tables (engine/verify_costs.py) go to a throwaway directory, not the user's cache. The
# xdist workers inherit the controller's directory: the tables are written atomically, and a
# table one worker measured saves the other the probe.
# The embedded model's dense conversion (macfleet/engine/gguf.py, ~540 MB) is cached there too:
# converted once per run, read back by every later process (agents, servers, ranks, workers).
_OWN_CACHE = "MACFLEET_CACHE" not in os.environ
os.environ.setdefault("MACFLEET_CACHE", tempfile.mkdtemp(prefix="macfleet-test-cache-"))
# Fleet keys and run directories (`macfleet up` without --key): one per process, so two xdist
# workers never share a fleet.key or a run/ state file, and no test touches ~/.macfleet.
os.environ["MACFLEET_HOME"] = tempfile.mkdtemp(prefix="macfleet-test-home-")
# litellm (tests/serve/test_clients.py) fetches a price list from the internet at import and
# retries with sleeps when offline: its bundled copy serves.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process that made the throwaway cache removes it (not an xdist worker: the
    controller's directory outlives them), so runs do not leave the conversion behind."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["MACFLEET_CACHE"], ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--serial", choices=("all", "skip", "only"), default="all",
                     help="run the tests marked `serial` too (all), not (skip: the parallel "
                          "pass of .ci/test), or only them (only: its pass alone)")


# A module whose every test is `slow` (a module-level `pytestmark` naming the marker) is not
# imported by the fast lane (`-m "not slow"`, exactly that expression): importing the 22 of them
# (openai, mlx-lm's generator, fleets' helpers) cost every worker ~2 s of its collection, and
# not one of their tests would run.
_WHOLLY_SLOW = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.slow\b", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if (config.getoption("markexpr", "").strip() == "not slow" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and _WHOLLY_SLOW.search(collection_path.read_text(encoding="utf-8"))):
        return True
    return None


@pytest.hookimpl(trylast=True)  # after -m/-k deselected: what is left is what would run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = config.getoption("--serial")
    if mode == "all":
        return
    want = mode == "only"
    keep = [it for it in items if (it.get_closest_marker("serial") is not None) == want]
    if mode == "skip" and os.environ.get("MACFLEET_SERIAL_FILES"):  # .ci/test: which files
        # hold serial tests of this selection: its serial pass collects only those (the whole
        # tree again would cost it ~10 s), or is not run at all when there are none
        files = sorted({it.path for it in items if it not in keep})
        with open(os.environ["MACFLEET_SERIAL_FILES"], "w") as f:
            f.write("".join(f"{p}\n" for p in ["collected", *files]))
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep
    if mode == "skip":
        items[:] = longest_first(items)


# The parallel pass hands whole files to the workers as they free up (xdist's loadfile): a long
# file handed out last keeps one worker busy while the other idles (45 s of the 1,350 s pass in
# docs/testing.md's third measurement: test_install's pip and test_smollm2_serve came last).
# These files go first, longest first (summed seconds of that loaded run); the rest follow by
# their number of `slow` tests (seconds each, by the marker's definition), then by their number
# of tests (.ci/test passes --no-loadscope-reorder): the pass ends on files of fast tests,
# small pieces that even the two workers out, not on one-test files that start a fleet or a
# server (xdist hands a worker its next file while the current one still has two tests to run).
LONGEST_FIRST = (  # seconds in a fresh-clone run, 2026-11-29; ~: the fifth round's estimate
    # (that run's seconds scaled by the file's CPU after / before its cuts: docs/testing.md)
    "serve/test_clients.py",  # 86
    "serve/test_structured.py",  # 56 (its cut within the noise of the measurement)
    "engine/test_greedy_identity.py",  # 35
    "serve/test_tool_grammar.py",  # 35
    "serve/test_prediction.py",  # ~34 (42 before)
    "engine/test_batch.py",  # 34
    "serve/test_fleet_serve.py",  # 33
    "serve/test_structured_trees.py",  # 33
    "cli/test_generate.py",  # 30
    "engine/test_tree.py",  # 29
    "agents/test_replan_grammar.py",  # 29
    "bench/test_pair_model.py",  # 24
    "serve/test_auto_drafting.py",  # 23
    "engine/test_sampling_lossless.py",  # ~21 (60 before)
    "integration/test_fleet_processes.py",  # ~15 (88 before)
)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with LONGEST_FIRST's files first (in that order), then the other files by their
    number of `slow` tests, then of tests, most first; a file's tests keep their order."""
    tests = os.path.dirname(__file__)
    rank = {os.path.join(tests, f): i for i, f in enumerate(LONGEST_FIRST)}
    by_file: dict[str, list[pytest.Item]] = {}
    for it in items:
        by_file.setdefault(str(it.path), []).append(it)

    def slow(f: str) -> int:
        return sum(it.get_closest_marker("slow") is not None for it in by_file[f])

    order = sorted(by_file, key=lambda f: (rank.get(f, len(rank)), -slow(f), -len(by_file[f])))
    return [it for f in order for it in by_file[f]]
