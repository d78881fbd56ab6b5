"""`macfleet plan --simulate`: a real subprocess, no fleet needed (a process each: slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "macfleet/topology/examples/desk-8-macs.json"
pytestmark = pytest.mark.slow  # the planner itself: tests/topology (pure, the fast lane)


def macfleet(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "macfleet", "plan", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_simulate_json(tmp_path):
    r = macfleet("--simulate", str(EXAMPLE), "--json", "--results", str(tmp_path))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["hosts"]) == 8
    best = d["plans"][0]
    assert best["feasible"] and best["topology"] == "verifier sharded over N"
    assert best["tokens_per_s"] > 0 and best["cost"]["block_ms"] > 0
    refused = [p for p in d["plans"] if not p["feasible"] and "causal" in p["reason"]]
    assert len(refused) == 1


def test_simulate_table_with_smollm2(tmp_path):
    f = tmp_path / "two.json"
    f.write_text(json.dumps({"hosts": [{"name": "a", "mem_free_gb": 8},
                                       {"name": "b", "mem_free_gb": 8}]}))
    r = macfleet("--simulate", str(f), "--proposer", "layerskip", "--results", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "1 proposer : 1 verifier" in r.stdout and "REFUSED" in r.stdout
    assert "default profile" in r.stdout


def test_split_sequence_is_refused_nonzero():
    r = macfleet("--split-sequence")
    assert r.returncode == 3
    assert "causal" in r.stderr and "token N+1" in r.stderr


def test_bad_file_is_a_user_error(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{"hosts": []}')
    r = macfleet("--simulate", str(f))
    assert r.returncode == 2 and "hosts" in r.stderr


def _words(text: str) -> list[str]:
    return " ".join(text.split()).split(" ")


def test_the_table_wraps_instead_of_cutting_and_ends_with_the_commands_of_its_first_plan():
    """Nothing of a placement or a reason is cut, at a narrow terminal or a wide one; the
    output ends with the commands that build the plan ranked first, one per host."""
    from macfleet.topology import SPLIT_SEQUENCE, plan, snapshot_from_dict

    fleet = snapshot_from_dict(json.loads(EXAMPLE.read_text()), None)  # it has its profile
    plans = plan(fleet)
    for width in (80, 200):
        r = subprocess.run([sys.executable, "-m", "macfleet", "plan", "--simulate",
                            str(EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS=str(width)))
        assert r.returncode == 0, r.stderr
        flat = " ".join(r.stdout.split())
        for q in plans:
            text = (", ".join(f"{a.host}={a.role}" for a in q.placement) if q.feasible
                    else q.reason.split(". ")[1] if q.topology == SPLIT_SEQUENCE else q.reason)
            assert " ".join(_words(text)) in flat, (width, text)
        table = r.stdout.split("\n\nlong prompts")[0]
        assert max(map(len, table.splitlines())) <= max(width, 120), width
        tail = r.stdout.split("to build the first plan (verifier sharded over N, 2):\n", 1)[1]
        lines = tail.splitlines()
        best = plans[0]
        for a, line in zip(best.placement, lines):
            assert line.split()[:2] == ["on", f"{a.host}:"], line
        assert "--role shard" in lines[0] and "--group-size 2 --rank 0 --shard-mode tensor" in \
            lines[0]
        assert lines[1].endswith("--rank 1 --shard-mode tensor")
        assert "--role proposer" in lines[2]
        assert "macfleet ls" in lines[3] and "macfleet generate --model llama-70b-4bit " \
            "--proposer draft:MODEL" in lines[4]
