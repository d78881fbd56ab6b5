"""SVG snapshots of the Batch panel (``dash --serve``), as test_dashboard_svg.py takes them.

Update after an intended visual change with
``python3 -m pytest tests/tui/test_batch_svg.py --snapshot-update -p no:cacheprovider``.
"""

from __future__ import annotations

import pytest
from test_batch_panel import DOWN, UP, served
from test_dashboard_svg import dashboard, shown
from tui_testkit import load

pytest.importorskip("pytest_textual_snapshot", reason="pytest-textual-snapshot not installed")

pytestmark = pytest.mark.slow  # each test runs the Textual app and renders an SVG


def test_batch_over_a_fleet_80x24(snap_compare, utc: None) -> None:
    snap = served(UP, load("two_hosts")[2])
    assert snap_compare(dashboard(snap), terminal_size=(80, 24),
                        run_before=shown(snap, "1204 iterations", "prefill 1200"))


def test_batch_alone_wide(snap_compare, utc: None) -> None:
    snap = served(UP)
    assert snap_compare(dashboard(snap), terminal_size=(140, 45),
                        run_before=shown(snap, "1204 iterations", "cancelled"))


def test_batch_server_down_80x24(snap_compare, utc: None) -> None:
    snap = served(DOWN)
    assert snap_compare(dashboard(snap), terminal_size=(80, 24),
                        run_before=shown(snap, "down: connection refused"))
