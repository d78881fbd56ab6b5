"""Facts about this machine: chip, memory, BLAS. Pure reads, no side effects."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def find_openblas() -> str | None:
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)


def blas_in_use() -> str:
    """Which BLAS this process has mapped (Linux); Accelerate on macOS."""
    if sys.platform == "darwin":
        return "Accelerate (Metal for MLX GPU ops)"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if "libopenblas" in maps:
        return "OpenBLAS (preloaded)"
    return "MLX reference BLAS (slow; install libopenblas0-pthread)"


def chip() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=2).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def memory_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def memory_free() -> int:
    """Available memory in bytes (MemAvailable on Linux; free+inactive pages on macOS)."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=2).stdout
            page = 16384 if platform.machine() == "arm64" else 4096
            vals = {l.split(":")[0]: int(l.split(":")[1].strip(" .")) for l in out.splitlines()[1:]
                    if ":" in l and l.split(":")[1].strip(" .").isdigit()}
            return page * (vals.get("Pages free", 0) + vals.get("Pages inactive", 0))
        except (OSError, subprocess.SubprocessError, ValueError):
            return 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return len(os.listdir("/dev/fd"))
