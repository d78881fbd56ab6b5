"""The Batch panel (``dash --serve``): its records, pure lines and cells, the watch source with
a fake fetch, and the panel in the running app (up, down, gone)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from macfleet.fleet.batch import (BatchView, IterationView, ServedSession, ServeView,
                                  percentile)
from macfleet.fleet.serve_watch import ServeWatchSource, batch_url, decode_batch
from macfleet.fleet.snapshot import FleetSnapshot, StaticSource
from tui.app import FleetDashboard
from tui.widgets.batch import (batch_title, iteration_lines, load_line, ordered_sessions,
                               session_cells)
from tui_testkit import FAST_REFRESH_S, FakeClock, load, wait_until, wait_visible

ITS = tuple(IterationView(100 + i * 0.03, 3 + i % 3, 9 + i % 5, 0 if i % 4 else 64, i % 2,
                          28.0 + i) for i in range(32))
SESSIONS = (ServedSession(12, "decode", 41, 0, 40, 180.0, 31.0, 72.5, 21, 34),
            ServedSession(13, "prefill", 2048, 1200, 0, None, None, None, 0, 0),
            ServedSession(14, "queued", 30, 29, 0, None, None, None, 0, 0),
            ServedSession(11, "done", 36, 0, 64, 95.2, 29.0, 60.1, 40, 60),
            ServedSession(10, "cancelled", 36, 0, 7, 120.0, 30.0, 33.0, 2, 8))
BATCH = BatchView("smollm2", "batched", True, 2, 1, 1204, ITS, SESSIONS)
UP = ServeView("http://127.0.0.1:8000", BATCH)
DOWN = ServeView("http://127.0.0.1:8000", error="connection refused (server not running?)")
T0 = 1_767_225_600.0


def served(view: ServeView | None, base: FleetSnapshot | None = None) -> FleetSnapshot:
    return replace(base or FleetSnapshot.empty(taken_at=T0), serve=view)


# -- records ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [ITS[0], SESSIONS[0], SESSIONS[1], BATCH, UP, DOWN])
def test_batch_records_round_trip_through_json(value) -> None:
    wire = json.loads(json.dumps(value.to_dict()))
    assert type(value).from_dict(wire) == value


def test_snapshots_carry_the_server_and_old_recordings_have_none() -> None:
    snap = served(UP, load("two_hosts")[2])
    assert FleetSnapshot.from_json(snap.to_json()) == snap
    old = json.loads(load("two_hosts")[2].to_json())
    assert "serve" not in old  # a fleet alone records as before
    assert FleetSnapshot.from_dict(old).serve is None


def test_server_state_and_session_activity() -> None:
    assert (UP.state, DOWN.state) == ("up", "down")
    assert ServeView("u", replace(BATCH, alive=False)).state == "no verifier"
    assert [s.active for s in SESSIONS] == [True, True, True, False, False]


def test_percentile_is_nearest_rank_like_bench_serve() -> None:
    assert percentile([], 0.5) is None
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 0.5) == 51.0 and percentile(xs, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0


# -- pure lines and cells ---------------------------------------------------------------------
def test_title_and_load_line() -> None:
    assert batch_title(UP) == "Batch · 127.0.0.1:8000 · up"
    assert batch_title(ServeView("http://h:1/v1")) == "Batch · h:1 · down"
    assert load_line(BATCH) == "2 active · 1 queued · 1204 iterations · smollm2"
    assert "1204 iterations on the verifier agent" in load_line(replace(BATCH, mode="fleet"))
    assert "one session at a time" in load_line(replace(BATCH, mode="fleet", iterations=0))


def test_iteration_lines_give_means_and_maxima() -> None:
    its = (IterationView(0, 2, 6, 0, 0, 10.0), IterationView(0, 4, 2, 64, 3, 30.0))
    assert iteration_lines(its) == (
        "per iteration, last 2: 3.0 sessions (max 4) · 20.0 ms (max 30.0)",
        "tokens: decode 4.0 (max 6) · prefill 32.0 (max 64) · queue 1.5 (max 3)")
    assert iteration_lines(()) == ("no iterations yet",)


def test_session_cells_show_state_latency_and_acceptance() -> None:
    cells = [c.plain for c in session_cells(SESSIONS[0])]
    assert cells == ["12", "decode", "41", "40", "180", "31.0", "72.5", "62%"]
    assert [c.plain for c in session_cells(SESSIONS[1])][:2] == ["13", "prefill 1200"]
    assert [c.plain for c in session_cells(SESSIONS[2])][4:] == ["—", "—", "—", "—"]
    assert session_cells(SESSIONS[3])[0].style == "dim"  # ended sessions are dimmed


def test_live_sessions_first_then_newest_ended() -> None:
    assert [s.sid for s in ordered_sessions(SESSIONS)] == [12, 13, 14, 11, 10]


# -- the watch source (fake fetch; the real one is tested against a server in tests/serve) ---
@pytest.mark.parametrize("given,want", [
    ("127.0.0.1:8000", "http://127.0.0.1:8000/v1/macfleet/batch"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/macfleet/batch"),
    ("http://h:9/v1/", "http://h:9/v1/macfleet/batch"),
    ("https://h/proxy/v1/macfleet/batch", "https://h/proxy/v1/macfleet/batch"),
])
def test_batch_url_takes_what_a_user_types(given: str, want: str) -> None:
    assert batch_url(given) == want


@pytest.mark.parametrize("bad", ["ftp://h/x", "http://", ""])
def test_batch_url_refuses_non_http(bad: str) -> None:
    with pytest.raises(ValueError):
        batch_url(bad)


def test_decode_batch_says_why_there_is_no_batch() -> None:
    ok = decode_batch("u", 200, json.dumps(BATCH.to_dict()).encode())
    assert ok == ServeView("u", BATCH)
    assert "API key" in decode_batch("u", 401, b"{}").error
    assert "not a macfleet server" in decode_batch("u", 404, b"").error
    assert decode_batch("u", 503, b"").error == "HTTP 503"
    for body in (b"not json", b"[1]", b'{"model": "m"}'):
        v = decode_batch("u", 200, body)
        assert v.batch is None and v.error.startswith("not a batch")


def test_watch_source_puts_the_view_on_the_newest_fleet_snapshot() -> None:
    fleet = load("two_hosts")
    calls = []

    def fetch(url, *, api_key, timeout_s):
        calls.append((url, api_key, timeout_s))
        return UP if len(calls) == 1 else DOWN

    src = ServeWatchSource("127.0.0.1:8000", StaticSource(fleet[:1]), api_key="k", fetch=fetch,
                           clock=lambda: T0)
    first = src.poll(0.5)
    assert first == served(UP, fleet[0])
    second = src.poll(0.02)  # the fleet sent nothing new: its last snapshot, the new view
    assert second == served(DOWN, fleet[0])
    assert calls[0] == ("127.0.0.1:8000", "k", 0.5)
    src.close()
    assert src.poll(0.5) is None and len(calls) == 2


def test_watch_source_without_a_fleet_and_bad_address() -> None:
    src = ServeWatchSource("h:1", fetch=lambda url, **kw: DOWN, clock=lambda: T0)
    assert src.poll(5.0) == served(DOWN)
    with pytest.raises(ValueError):
        ServeWatchSource("ftp://h")


# -- the panel in the app ---------------------------------------------------------------------
@pytest.mark.slow  # runs the Textual app
def test_panel_shows_the_batch_then_down_then_hides() -> None:
    asyncio.run(_panel_scenario())


async def _panel_scenario() -> None:
    source = StaticSource()
    app = FleetDashboard(source, refresh_s=FAST_REFRESH_S, clock=FakeClock())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert not app.batch_panel.display  # nothing watched: no panel at all
        source.push(served(UP))
        screen = await wait_visible(pilot, app, "Batch · 127.0.0.1:8000 · up",
                                    "1204 iterations", "4.0 sessions", "prefill 1200")
        assert "ITL p50" in screen and "TTFT" in screen
        source.push(served(DOWN))
        await wait_visible(pilot, app, "down: connection refused", "Batch · 127.0.0.1:8000 · down")
        await wait_visible(pilot, app, "ITL p50", present=False)
        source.push(served(ServeView(UP.url, replace(BATCH, alive=False, recent=()))))
        await wait_visible(pilot, app, "no verifier: requests are answered 503",
                           "no iterations yet")
        source.push(FleetSnapshot.empty(taken_at=T0))
        await wait_until(pilot, lambda: not app.batch_panel.display, what="panel hidden")
