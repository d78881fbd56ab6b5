"""Fleet snapshot types: JSON round trips, tolerant decoding, and the snapshot sources."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from macfleet.fleet.snapshot import (
    EMPTY_SNAPSHOT, BlockSample, FleetEvent, FleetSnapshot, FlowView, HostView, LinkView,
    RecordingSource, ReplaySource, SessionView, SnapshotFormatError, StaticSource, read_jsonl,
    write_jsonl,
)
from tui_testkit import FIXTURES, load

HOST = HostView("n1", "studio", "M2 Ultra", ("verifier", "shard"), ("qwen-7b",), 10, 100,
                0.5, 0.4, None, True, "tcp://10.0.0.1:5755")
FLOW = FlowView("F3", 35840.0, 6.4, 0.17, True, (5.0, 6.0, 6.4))
BLOCK = BlockSample(3, 4, 2, 40.0, 4.0, 33.0, 3.0)
SESSION = SessionView("s1", "studio", ("air", "mini"), "2p:1v", 61.5, 0.6, 2.4, 4, 30,
                      (1, 2, 3, 4, 5), (FLOW,), (BLOCK,), 0.03, True)
SNAP = FleetSnapshot(1000.5, "lab", (HOST,), (LinkView("air", "studio", 1.9, None),),
                     (SESSION,), (FleetEvent(999.0, "join", "studio joined"),))


@pytest.mark.parametrize("value", [HOST, FLOW, BLOCK, SESSION, SNAP.links[0], SNAP.events[0]])
def test_each_view_round_trips_through_json(value: object) -> None:
    cls = type(value)
    wire = json.loads(json.dumps(value.to_dict()))  # tuples become lists on the way
    assert cls.from_dict(wire) == value


def test_fleet_snapshot_round_trips_and_carries_version() -> None:
    d = SNAP.to_dict()
    assert d["v"] == 1
    assert FleetSnapshot.from_dict(d) == SNAP
    assert FleetSnapshot.from_json(SNAP.to_json()) == SNAP
    assert "\n" not in SNAP.to_json()  # one snapshot per JSON line


def test_views_are_frozen_and_hashable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        HOST.name = "other"  # type: ignore[misc]
    assert len({SNAP, FleetSnapshot.from_json(SNAP.to_json())}) == 1


def test_empty_snapshot_and_helpers() -> None:
    assert EMPTY_SNAPSHOT.hosts == () and EMPTY_SNAPSHOT.sessions == ()
    assert FleetSnapshot.empty("lab", 5.0) == FleetSnapshot(5.0, "lab")
    assert HOST.mem_fraction == pytest.approx(0.1)
    assert dataclasses.replace(HOST, mem_total=0).mem_fraction == 0.0
    assert SESSION.flow("F3") is FLOW and SESSION.flow("F1") is None


def test_decoding_ignores_unknown_keys_and_defaults_optional_ones() -> None:
    d = SNAP.to_dict()
    d["future_field"] = 1
    d["hosts"][0]["gpu_cores"] = 76
    del d["events"]
    del d["sessions"][0]["flows"][0]["history"]
    snap = FleetSnapshot.from_dict(d)
    assert snap.events == () and snap.sessions[0].flows[0].history == ()


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("fleet_id"),
    lambda d: d["hosts"][0].pop("name"),
    lambda d: d["hosts"][0].__setitem__("roles", "verifier"),  # a string is not a list
    lambda d: d["sessions"][0].__setitem__("blocks", "many"),
    lambda d: d.__setitem__("v", 99),
])
def test_bad_snapshots_raise_one_error_type(mutate) -> None:
    d = SNAP.to_dict()
    mutate(d)
    with pytest.raises(SnapshotFormatError):
        FleetSnapshot.from_dict(d)


@pytest.mark.parametrize("line", ["not json", "[1, 2]", "{}"])
def test_bad_json_lines_raise_format_error(line: str) -> None:
    with pytest.raises(SnapshotFormatError):
        FleetSnapshot.from_json(line)


def test_jsonl_write_read_skips_garbage(tmp_path: Path, caplog) -> None:
    path = tmp_path / "rec.jsonl"
    assert write_jsonl(path, [SNAP, EMPTY_SNAPSHOT]) == 2
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n{broken\n")
    assert read_jsonl(path) == [SNAP, EMPTY_SNAPSHOT]
    assert "skipped" in caplog.text


def test_static_source_hands_out_in_order_then_none() -> None:
    src = StaticSource([SNAP, EMPTY_SNAPSHOT])
    assert src.poll(0.0) is SNAP
    assert src.poll(0.0) is EMPTY_SNAPSHOT
    assert src.poll(0.01) is None
    src.push(SNAP)
    assert src.poll(0.0) is SNAP


def test_close_wakes_a_blocked_poll() -> None:
    for src in (StaticSource(), ReplaySource(FIXTURES / "empty_fleet.jsonl")):
        while src.poll(0.0) is not None:
            pass
        result: list[object] = []
        t = threading.Thread(target=lambda s=src, r=result: r.append(s.poll(30.0)))
        started = time.monotonic()
        t.start()
        time.sleep(0.05)
        src.close()
        t.join(5.0)
        assert result == [None] and time.monotonic() - started < 5.0
        src.close()  # idempotent


def test_replay_source_plays_a_fixture_and_can_loop() -> None:
    once = ReplaySource(FIXTURES / "host_vanishes.jsonl")
    got = [once.poll(0.0) for _ in range(3)]
    assert got == load("host_vanishes") and once.poll(0.0) is None
    looping = ReplaySource(FIXTURES / "empty_fleet.jsonl", loop=True)
    assert [looping.poll(0.0) for _ in range(3)] == [*load("empty_fleet"), load("empty_fleet")[0]]


def test_replay_source_missing_file_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ReplaySource(tmp_path / "nope.jsonl")


def test_recording_source_tees_to_a_replayable_file(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    with RecordingSource(StaticSource([SNAP, EMPTY_SNAPSHOT]), path) as rec:
        assert rec.poll(0.0) == SNAP and rec.poll(0.0) == EMPTY_SNAPSHOT
        assert rec.poll(0.0) is None
    assert read_jsonl(path) == [SNAP, EMPTY_SNAPSHOT]


def test_committed_fixtures_match_the_generator() -> None:
    spec = importlib.util.spec_from_file_location("make_fixtures",
                                                  FIXTURES.parent / "make_fixtures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for fname, text in module.render_all().items():
        assert (FIXTURES / fname).read_text(encoding="utf-8") == text, (
            f"{fname} is stale: run python3 tests/tui/make_fixtures.py")
