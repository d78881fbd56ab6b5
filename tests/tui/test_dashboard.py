"""Pilot tests of the fleet dashboard, fed with recorded snapshots through real sources."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from macfleet.fleet.snapshot import (FleetSnapshot, ReplaySource, SnapshotSource,
                                     StaticSource)
from tui.app import FleetDashboard
from tui.screens.session_detail import SessionDetailScreen
from tui.widgets.histogram import AcceptHistogram
from tui.widgets.table import row_keys
from tui_testkit import FAST_REFRESH_S, FIXTURES, FakeClock, load, wait_until, wait_visible

SMALL = (80, 24)
LARGE = (140, 45)

Scenario = Callable[[Pilot, FleetDashboard, StaticSource], Awaitable[None]]


def drive(scenario: Scenario, size: tuple[int, int] = SMALL, *,
          stall_after_s: float = 30.0, source: SnapshotSource | None = None,
          clock: Callable[[], float] | None = None) -> FleetDashboard:
    """Run ``scenario`` against a dashboard fed by a pushable source; returns the app."""
    src = source or StaticSource()
    app = FleetDashboard(src, refresh_s=FAST_REFRESH_S, stall_after_s=stall_after_s,
                         **({"clock": clock} if clock else {}))

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await scenario(pilot, app, src)  # type: ignore[arg-type]

    asyncio.run(main())
    return app


async def show(pilot: Pilot, app: FleetDashboard, src: StaticSource,
               snap: FleetSnapshot) -> None:
    """Push ``snap`` through the source and wait until the worker delivered it."""
    before = app.received
    src.push(snap)
    await wait_until(pilot, lambda: app.received > before, what="snapshot delivery")
    await pilot.pause()  # rows mounted by the update (flow rows) compose one turn later


def host_rows(app: FleetDashboard) -> list[str]:
    return row_keys(app.hosts.query_one(DataTable))


@pytest.mark.slow  # runs the Textual app
@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_hosts_sessions_links_and_flows_appear(size: tuple[int, int]) -> None:
    snap = load("two_hosts")[0]

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, snap)
        assert host_rows(app) == ["n-air", "n-studio"]  # sorted by name
        assert row_keys(app.sessions.query_one(DataTable)) == ["s-7f3a"]
        assert row_keys(app.links.query_one(DataTable)) == ["air>studio"]
        assert app.flows.flow_names() == ["F1", "F2", "F3 probe"]
        await wait_visible(pilot, app, "studio", "air", "SmolLM2-135M", "s-7f3a",
                           "air→studio", "F3 probe", "2 hosts", "studio joined")
        if size == LARGE:
            await wait_visible(pilot, app, "M2 Ultra", "Accepted tokens per block")

    drive(scenario, size)


@pytest.mark.slow  # runs the Textual app
def test_s_cycles_host_sort_order() -> None:
    snap = load("two_hosts")[0]  # air: rtt 1.9, mem 7%, load .34; studio: .05, 5%, .61

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, snap)
        seen = [(app.host_sort, host_rows(app))]
        for _ in range(4):
            await pilot.press("s")
            await pilot.pause()
            seen.append((app.host_sort, host_rows(app)))
        assert seen == [("name", ["n-air", "n-studio"]), ("rtt", ["n-studio", "n-air"]),
                        ("memory", ["n-air", "n-studio"]), ("load", ["n-studio", "n-air"]),
                        ("name", ["n-air", "n-studio"])]
        assert "sort: name" in app.hosts.border_title

    drive(scenario, LARGE)


@pytest.mark.slow  # runs the Textual app
@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_host_marked_dead_then_removed(size: tuple[int, int]) -> None:
    first, dead, gone = load("host_vanishes")

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, first)
        assert host_rows(app) == ["n-air", "n-mini", "n-studio"]
        await show(pilot, app, src, dead)
        mini = " ".join(str(c) for c in app.hosts.query_one(DataTable).get_row("n-mini"))
        assert ("DEAD" if size == SMALL else "lost 4.2s") in mini
        await wait_visible(pilot, app, "✗ mini", "(1 dead)")
        await show(pilot, app, src, gone)
        assert host_rows(app) == ["n-air", "n-studio"]
        assert "mini" not in str(app.hosts.query_one(DataTable).get_row("n-air"))
        kinds = [e.kind for e in app.events.written]
        assert kinds.count("join") == 3 and "heartbeat_lost" in kinds and "leave" in kinds

    drive(scenario, size)


@pytest.mark.slow  # runs the Textual app
def test_p_pauses_and_resumes_with_the_latest_snapshot() -> None:
    first, _, gone = load("host_vanishes")

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, first)
        await pilot.press("p")
        await pilot.pause()
        assert app.paused
        await wait_visible(pilot, app, "PAUSED")
        await show(pilot, app, src, gone)
        assert app.snapshot is first and app.pending is gone
        assert host_rows(app) == ["n-air", "n-mini", "n-studio"]  # frozen while paused
        await pilot.press("s")  # sorting still works on the frozen view
        await pilot.pause()
        assert host_rows(app)[0] == "n-studio"
        await pilot.press("p")
        await pilot.pause()
        assert not app.paused
        await wait_visible(pilot, app, "PAUSED", present=False)
        assert app.snapshot is gone and host_rows(app) == ["n-studio", "n-air"]

    drive(scenario)


@pytest.mark.slow  # runs the Textual app
@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_enter_opens_session_detail_and_escape_returns(size: tuple[int, int]) -> None:
    snaps = load("two_hosts")

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, snaps[0])
        assert app.focused is app.sessions.query_one(DataTable)
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, SessionDetailScreen),
                         what="detail screen")
        detail = app.screen
        hist = detail.query_one(AcceptHistogram)
        assert hist.hist == snaps[0].sessions[0].accepted_hist
        await wait_visible(pilot, app, "Accepted tokens per block", "█", "3/4")
        table = detail.query_one("#detail-timeline", DataTable)
        assert table.row_count == len(snaps[0].sessions[0].timeline)
        await show(pilot, app, src, snaps[1])  # the detail follows live snapshots
        assert hist.hist == snaps[1].sessions[0].accepted_hist
        await show(pilot, app, src, dataclasses.replace(snaps[2], sessions=()))
        await wait_visible(pilot, app, "no longer reported")
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, SessionDetailScreen)
        await wait_visible(pilot, app, "Hosts")

    drive(scenario, size)


@pytest.mark.slow  # runs the Textual app
def test_highlighting_a_session_switches_the_flows_panel() -> None:
    snap = load("two_hosts")[0]
    s1 = snap.sessions[0]
    s2 = dataclasses.replace(s1, session_id="s-b2", flows=s1.flows[:1])
    snap = dataclasses.replace(snap, sessions=(s1, s2))

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, snap)
        assert "s-7f3a" in app.flows.border_title
        await pilot.press("down")
        await wait_until(pilot, lambda: "s-b2" in app.flows.border_title, what="switch")
        assert app.flows.flow_names() == ["F1"]
        await show(pilot, app, src, snap)  # a refresh keeps the user's selection
        assert "s-b2" in app.flows.border_title

    drive(scenario, LARGE)


@pytest.mark.slow  # runs the Textual app
@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_empty_fleet_says_no_agents_yet(size: tuple[int, int]) -> None:
    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await wait_visible(pilot, app, "no agents discovered yet")  # before any snapshot
        await show(pilot, app, src, load("two_hosts")[0])
        await wait_visible(pilot, app, "no agents discovered yet", present=False)
        assert app.focused is app.sessions.query_one(DataTable)  # enter works at once
        await show(pilot, app, src, load("empty_fleet")[0])
        await wait_visible(pilot, app, "no agents discovered yet", "no sessions",
                           "no active session")
        assert host_rows(app) == []

    drive(scenario, size)


@pytest.mark.slow  # runs the Textual app
def test_stalled_source_is_reported_then_cleared(utc: None) -> None:
    clock = FakeClock()  # 2026-01-01 00:00:00 UTC

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, load("two_hosts")[0])
        clock.advance(2.0)  # under the 3 s limit: fine
        await pilot.pause(5 * FAST_REFRESH_S)
        assert app.status_bar.stalled_since is None
        clock.advance(2.0)
        await wait_visible(pilot, app, "metrics stream stalled since 00:00:00")
        await show(pilot, app, src, load("two_hosts")[1])
        await wait_visible(pilot, app, "stalled since", present=False)
        texts = [e.text for e in app.events.written]
        assert "metrics stream stalled" in texts and "metrics stream resumed" in texts

    drive(scenario, stall_after_s=3.0, clock=clock)


@pytest.mark.slow  # runs the Textual app
def test_replay_runs_to_the_end_then_stalls() -> None:
    source = ReplaySource(FIXTURES / "two_hosts.jsonl")
    clock = FakeClock()  # frozen while the replay plays: a slow machine cannot fake a stall

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await wait_until(pilot, lambda: app.received == 6, what="whole replay")
        assert app.snapshot == load("two_hosts")[-1]
        # only the fleet's own events, each once: windows de-duplicated, no stall notices
        assert list(app.events.written) == list(load("two_hosts")[-1].events)
        clock.advance(1.0)  # past the limit with nothing more to play
        await wait_until(pilot, lambda: app.status_bar.stalled_since is not None,
                         what="stall after replay")

    drive(scenario, source=source, stall_after_s=0.3, clock=clock)


class BrokenSource(SnapshotSource):
    """A live source whose socket died: poll raises."""

    def __init__(self) -> None:
        self.closed = False

    def poll(self, timeout_s: float) -> FleetSnapshot | None:
        raise ConnectionError("metrics socket gone")

    def close(self) -> None:
        self.closed = True


@pytest.mark.slow  # runs the Textual app
def test_failing_source_is_shown_not_crashed() -> None:
    source = BrokenSource()

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await wait_visible(pilot, app, "metrics source failed")
        assert "metrics socket gone" in app.status_bar.plain
        await pilot.press("s")  # still interactive
        await pilot.pause()
        assert app.host_sort == "rtt"

    drive(scenario, source=source)
    assert source.closed


@pytest.mark.slow  # runs the Textual app
def test_q_quits_and_closes_the_source() -> None:
    src = StaticSource()

    async def scenario(pilot: Pilot, app: FleetDashboard, _: StaticSource) -> None:
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    app = drive(scenario, source=src)
    assert app.return_code == 0
    assert src.poll(0.0) is None and src._closed  # closed on unmount, wakes the worker


def test_refresh_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FleetDashboard(StaticSource(), refresh_s=0)


def auto_session_view():
    """A `--proposer auto` session's view (issue 44) from its agent's BlockMetrics: which
    candidate drafted each block and why."""
    from bridge.messages import BlockMetrics
    from macfleet.fleet.metrics import SessionMetrics

    def block(i: int, drafter: str, why: str) -> BlockMetrics:
        return BlockMetrics(node_id="v", session_id="s", block=i, k=0 if drafter == "none"
                            else 6, accepted=1, block_ms=40.0, draft_ms=2.0, verify_ms=38.0,
                            f1_bytes=0, f1_ms=0.0, f2_bytes=0, f2_ms=0.0, f3_bytes=0,
                            f3_ms=0.0, probe=False, drafter=drafter, why=why)

    m = SessionMetrics("s-auto", "studio")
    picks = [("eagle", "prior"), ("eagle2", "explore"), *[("eagle2", "best")] * 5,
             ("none", "best"), ("eagle", "explore"), ("eagle2", "best")]
    for i, (d, w) in enumerate(picks, 1):
        m.apply(block(i, d, w), now=100.0)
    fixed = SessionMetrics("s-fixed", "studio")
    fixed.apply(block(1, "", ""), now=100.0)
    return m.view(now=100.0), fixed.view(now=100.0)


def test_auto_drafting_is_counted_in_the_session_view() -> None:
    """The session's view counts the blocks each candidate drafted and keeps the latest
    choice; a fixed drafter's session (and every older recording) carries none of it."""
    from macfleet.fleet.snapshot import DrafterShare, SessionView

    view, plain = auto_session_view()
    assert (view.drafter, view.why) == ("eagle2", "best")
    assert view.drafters == (DrafterShare("eagle2", 7, 1), DrafterShare("eagle", 2, 1),
                             DrafterShare("none", 1, 0))
    assert view.drafter_share("eagle2") == pytest.approx(0.7)
    assert SessionView.from_dict(view.to_dict()) == view
    assert plain.drafters == () and "drafters" not in plain.to_dict()


@pytest.mark.slow  # runs the Textual app
def test_auto_drafting_reaches_the_session_detail() -> None:
    """The session's detail shows the latest choice and every candidate's share of the
    blocks."""
    view, _ = auto_session_view()
    snap = dataclasses.replace(load("two_hosts")[0], sessions=(view,))

    async def scenario(pilot: Pilot, app: FleetDashboard, src: StaticSource) -> None:
        await show(pilot, app, src, snap)
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, SessionDetailScreen),
                         what="detail screen")
        await wait_visible(pilot, app, "auto drafting eagle2 (best)", "eagle2 70.0%",
                           "eagle 20.0%", "none 10.0%", "2 tried")

    drive(scenario, LARGE)
