"""`macfleet bench serve --prediction`: its workloads, the held share, the summary, and a short
run on the tiny model that writes results/serve_prediction.json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from macfleet.bench.prediction_sources import SOURCES
from macfleet.bench.serve_prediction import (ANSWER, COMPLETIONS, SHOT, WORKLOADS, _median,
                                              held_share, one_shot, pair_order, requests,
                                              summary)


def test_the_files_are_100_to_400_lines_and_each_gets_every_workload():
    for name, _, code, (old, _) in SOURCES:
        assert 100 <= len(code.splitlines()) <= 400, name
        assert old in code
    reqs = requests()
    assert len(reqs) == len(SOURCES) * len(WORKLOADS)
    by = {(r["file"], r["workload"]): r for r in reqs}
    name, _, code, (old, new) = SOURCES[0]
    assert by[(name, "copy")]["prediction"] == code and code in by[(name, "copy")]["ask"]
    guess = by[(name, "edit-guess")]["prediction"]
    assert old not in guess and new in guess and by[(name, "edit")]["prediction"] == code
    assert by[(name, "useless")]["prediction"] == SOURCES[1][2]
    short = requests(lines=5, workloads=("copy",))
    assert [len(r["prediction"].splitlines()) for r in short] == [5] * len(SOURCES)
    for (_, w), r in by.items():
        assert r["endpoint"] == ("completions" if w in COMPLETIONS else "chat")
    # the completion prompts end where the copy starts; the edit's prediction is the original
    cc, ce = by[(name, "complete-copy")], by[(name, "complete-edit")]
    assert cc["prediction"] == ce["prediction"] == code
    assert cc["ask"].endswith(f"{code}```\nCopy:\n```python\n")
    assert ce["ask"].endswith(f"{code}```\nWith `{old}` renamed to `{new}`:\n```python\n")
    regen = by[(name, "regenerate")]
    assert regen["prediction"] is ANSWER and regen["ask"] == by[(name, "copy")]["ask"]


def test_the_one_shot_prompt_shows_the_same_change_on_a_short_function():
    copy, edit = one_shot("go", "package x\n"), one_shot("go", "package x\n", ("a", "b"))
    assert copy.count(SHOT) == 2 and copy.startswith(f"Original:\n```python\n{SHOT}```")
    assert edit.count(SHOT) == 1 and SHOT.replace("total", "result") in edit
    assert "renamed to `result`" in edit and edit.endswith("renamed to `b`:\n```go\n")


def test_held_share_and_summary():
    assert held_share("abcdef", "abcdef") == 1.0
    assert held_share("abcXYZ", "abc") == 0.5
    assert held_share("", "abc") == 0.0
    rows = [{"workload": "copy", "speedup": 4.0, "held_share": 0.9, "accepted_share": 0.8,
             "same_answer": True},
            {"workload": "copy", "speedup": 1.0, "held_share": 0.3, "accepted_share": 0.1,
             "same_answer": True},
            {"workload": "useless", "speedup": 0.97, "held_share": 0.1, "accepted_share": 0.0,
             "same_answer": True}]
    s = summary(rows)
    assert s["copy"]["speedup_geomean"] == 2.0 and s["copy"]["speedup_min"] == 1.0
    assert s["copy"]["steps_ratio_geomean"] is None  # rows without steps
    assert s["by_held_share"]["held>=0.8"] == {"requests": 1, "speedup_geomean": 4.0}
    assert s["by_held_share"]["held<0.5"]["requests"] == 2
    assert (s["same_answers"], s["requests"]) == (3, 3)


def test_repeats_alternate_after_the_first_pair_and_the_ratio_is_of_medians():
    assert pair_order(1) == [False, True]  # regenerate predicts the first plain answer
    assert pair_order(2) == [False, True, True, False]
    assert pair_order(3) == [False, True, True, False, False, True]
    for n in range(1, 6):
        order = pair_order(n)
        assert order.count(True) == order.count(False) == n and order[0] is False
    with pytest.raises(ValueError):
        pair_order(0)
    assert _median([3.0, 1.0, 2.0]) == 2.0 and _median([4.0, 1.0, 2.0, 3.0]) == 2.5


@pytest.mark.slow  # a `macfleet serve` process
def test_bench_serve_prediction_writes_its_rows(tmp_path):
    r = subprocess.run([sys.executable, "-m", "macfleet", "bench", "--model", "tiny:1",
                        "--out", str(tmp_path), "serve", "--prediction", "--lines", "4",
                        "--workloads", "copy,useless", "--max-tokens", "24",
                        "--repeats", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "serve_prediction.json").read_text())
    assert res["command"].startswith("macfleet bench") and "--prediction" in res["command"]
    assert len(res["rows"]) == 2 * len(SOURCES) and res["repeats"] == 2
    for row in res["rows"]:
        assert row["same_answer"] and row["speedup"] > 0
        assert len(row["plain_s"]) == len(row["predicted_s"]) == 2
        assert row["speedup"] == round(_median(row["plain_s"]) / _median(row["predicted_s"]), 3)
        assert row["plain"]["accepted_prediction"] == row["plain"]["rejected_prediction"] == 0
    assert "same answers: 6/6" in r.stdout


@pytest.mark.slow  # a local fleet (`macfleet up`) and `macfleet serve` in front of it
def test_bench_serve_prediction_through_a_fleet_writes_its_rows(tmp_path):
    r = subprocess.run([sys.executable, "-m", "macfleet", "bench", "--model", "tiny:1",
                        "--out", str(tmp_path), "serve", "--prediction", "--fleet", "--lines",
                        "4", "--workloads", "complete-copy,regenerate", "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "serve_prediction_fleet.json").read_text())
    assert "macfleet up" in res["server"] and len(res["rows"]) == 2 * len(SOURCES)
    for row in res["rows"]:
        assert row["same_answer"] and row["speedup"] > 0
        assert row["plain"]["accepted_prediction"] == 0
        if row["workload"] == "regenerate":  # its own answer: held all along, and taken
            assert row["held_share"] == 1.0 and row["predicted"]["accepted_prediction"] > 0
    assert "same answers: 6/6" in r.stdout
