"""SVG snapshot tests of the dashboard (pytest-textual-snapshot), from recorded fleets.

Update after an intended visual change with
``python3 -m pytest tests/tui/test_dashboard_svg.py --snapshot-update -p no:cacheprovider``
and look at the SVGs under ``__snapshots__/`` before committing them.
"""

from __future__ import annotations

import pytest
from textual.pilot import Pilot

from macfleet.fleet.snapshot import FleetSnapshot, StaticSource
from tui.app import FleetDashboard
from tui_testkit import FakeClock, load, wait_until, wait_visible

pytest.importorskip("pytest_textual_snapshot", reason="pytest-textual-snapshot not installed")

pytestmark = pytest.mark.slow  # each test runs the Textual app and renders an SVG

SLOW_REFRESH_S = 5.0  # one poll delivers the snapshot; nothing else moves during the shot


def dashboard(snap: FleetSnapshot, clock: FakeClock | None = None) -> FleetDashboard:
    return FleetDashboard(StaticSource([snap]), refresh_s=SLOW_REFRESH_S,
                          clock=clock or FakeClock())


def shown(snap: FleetSnapshot, *texts: str):
    """``run_before`` hook: wait until ``snap`` is on screen (and ``texts`` are visible)."""
    async def run_before(pilot: Pilot) -> None:
        app = pilot.app
        await wait_until(pilot, lambda: app.snapshot is snap, what="snapshot applied")
        await wait_visible(pilot, app, *texts)
    return run_before


def test_fleet_generating_80x24(snap_compare, utc: None) -> None:
    snap = load("two_hosts")[2]
    assert snap_compare(dashboard(snap), terminal_size=(80, 24),
                        run_before=shown(snap, "F3 probe", "studio joined"))


def test_dead_host_wide(snap_compare, utc: None) -> None:
    snap = load("host_vanishes")[1]
    assert snap_compare(dashboard(snap), terminal_size=(140, 45),
                        run_before=shown(snap, "lost 4.2s", "hb lost", "Accepted tokens"))


def test_session_detail_80x24(snap_compare, utc: None) -> None:
    snap = load("two_hosts")[3]

    async def run_before(pilot: Pilot) -> None:
        await shown(snap, "s-7f3a")(pilot)
        await pilot.press("enter")
        await wait_visible(pilot, pilot.app, "Accepted tokens per block", "Timeline")

    assert snap_compare(dashboard(snap), terminal_size=(80, 24), run_before=run_before)


def test_empty_fleet_stalled_and_paused_80x24(snap_compare, utc: None) -> None:
    snap = load("empty_fleet")[0]
    clock = FakeClock()

    async def run_before(pilot: Pilot) -> None:
        await shown(snap, "no agents discovered yet")(pilot)
        clock.advance(60.0)  # no snapshot for 60 s of dashboard time
        await pilot.press("p")
        await wait_visible(pilot, pilot.app, "PAUSED", "metrics stream stalled since")

    assert snap_compare(dashboard(snap, clock), terminal_size=(80, 24), run_before=run_before)
