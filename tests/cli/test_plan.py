"""`macfleet plan --simulate`: a real subprocess, no fleet needed (fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "macfleet/topology/examples/desk-8-macs.json"


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
