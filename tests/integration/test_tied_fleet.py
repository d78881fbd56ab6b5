"""A local fleet tied to the process that started it (`macfleet demo`, the tests' fleets:
`local.up(tied=True)`, agents run with `--exit-with PID`) goes when that process goes, even
when it is killed (SIGKILL: no `finally`, no `macfleet down`): real agent processes on the
tiny model, a real starter process killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STARTER = """
import json, sys, time
from pathlib import Path
from macfleet.fleet import local
from macfleet.fleet.keys import keygen
tmp = Path(sys.argv[1])
key = keygen(tmp / "fleet.key")
local.up(2, model="tiny:1", key=key, key_path=tmp / "fleet.key", run_dir=tmp / "run",
         timeout_s=120, tied=True)
print(json.dumps([a.pid for a in local.read_state(tmp / "run")]), flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Ended (a zombie nobody reaps counts: it runs no code)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def test_agents_of_a_killed_starter_stop(tmp_path):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = starter.stdout.readline()
        assert line, "the starter printed no agents"
        pids = json.loads(line)
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 30  # a second's check, then a clean stop
        while time.monotonic() < deadline and not all(gone(p) for p in pids):
            time.sleep(0.2)
        assert all(gone(p) for p in pids), "agents outlived the process that started them"
    finally:
        starter.kill()
        for p in pids:
            if not gone(p):
                os.kill(p, signal.SIGKILL)
