"""Suite-wide: puts tests/ on sys.path so `tolerance` (shared float bounds) imports anywhere;
keeps measured tables and fleet keys out of the user's home; splits the run into the tests that
may share the machine and the `serial` ones (`--serial`, used by .ci/test; docs/testing.md)."""

import os
import tempfile

import pytest

# Measured tables (engine/verify_costs.py) go to a throwaway directory, not the user's cache. The
# xdist workers inherit the controller's directory: the tables are written atomically, and a
# table one worker measured saves the other the probe.
os.environ.setdefault("MACFLEET_CACHE", tempfile.mkdtemp(prefix="macfleet-test-cache-"))
# Fleet keys and run directories (`macfleet up` without --key): one per process, so two xdist
# workers never share a fleet.key or a run/ state file, and no test touches ~/.macfleet.
os.environ["MACFLEET_HOME"] = tempfile.mkdtemp(prefix="macfleet-test-home-")
# litellm (tests/serve/test_clients.py) fetches a price list from the internet at import and
# retries with sleeps when offline: its bundled copy serves.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--serial", choices=("all", "skip", "only"), default="all",
                     help="run the tests marked `serial` too (all), not (skip: the parallel "
                          "pass of .ci/test), or only them (only: its pass alone)")


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
