"""A real local fleet for integration tests: temp key and run dir, cards by role, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
from macfleet.fleet import local
from macfleet.fleet.keys import keygen


@contextlib.contextmanager
def local_fleet(tmp: Path, model: str = "smollm2", timeout_s: float = 120) -> Iterator[dict]:
    key_path = tmp / "fleet.key"
    key = keygen(key_path)
    run_dir = tmp / "run"
    cards = local.up(2, model=model, key=key, key_path=key_path, run_dir=run_dir,
                     timeout_s=timeout_s, tied=True)
    try:
        yield {"key": key, "key_path": key_path, "run_dir": run_dir,
               "verifier": next(c for c in cards if ROLE_VERIFIER in c.roles),
               "proposer": next(c for c in cards if ROLE_PROPOSER in c.roles),
               "agents": {a.role: a for a in local.read_state(run_dir)}}
    finally:
        for a in local.read_state(run_dir):  # a stopped (SIGSTOP) agent cannot handle SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(a.pid, signal.SIGCONT)
        local.down(run_dir)
