"""How the robustness benchmarks (`bench security`'s fuzz doors, the closed fleet's attacks) judge
a process they started: a reply later than HANG_S is a hang; its resident memory, open files and
open-file limit are read from /proc (-1 where there is no /proc, or the process is gone).
"""

from __future__ import annotations

import os
from pathlib import Path

HANG_S = 5.0  # a reply (or a ping after an attack) later than this is a hang


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return -1.0


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def fd_limit(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return -1
