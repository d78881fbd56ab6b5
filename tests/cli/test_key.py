"""`macfleet key export | macfleet key import`: the key crosses to another Mac as one line,
through the real CLI in real processes, and lands private; a bad line or another fleet's key
file changes nothing."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from macfleet.fleet import keys

pytestmark = pytest.mark.timeout(120)


def _cli(args, env, stdin=None):
    return subprocess.run([sys.executable, "-m", "macfleet", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def two_macs(tmp_path):
    """Two MACFLEET_HOMEs: the first Mac with a key, the second without."""
    envs = []
    for name in ("mac1", "mac2"):
        env = dict(os.environ, MACFLEET_HOME=str(tmp_path / name), MACFLEET_NO_OPENBLAS="1")
        env.pop("MACFLEET_KEY", None)
        envs.append(env)
    key = keys.keygen(tmp_path / "mac1" / "fleet.key")
    return key, envs[0], envs[1], tmp_path / "mac2" / "fleet.key"


def test_export_then_import_through_a_pipe(two_macs):
    key, mac1, mac2, dest = two_macs
    out = _cli(["key", "export"], mac1)
    assert out.returncode == 0, out.stderr
    line = out.stdout
    assert line.count("\n") == 1 and line.startswith("macfleet-key-v1:")  # only the line
    assert "fleet id" in out.stderr
    got = _cli(["key", "import"], mac2, stdin=line)  # no LINE: read from stdin
    assert got.returncode == 0, got.stderr
    assert keys.load_key(dest) == key
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    fid = out.stderr.split("fleet id ")[1].split(";")[0]
    assert f"fleet id {fid}" in got.stdout  # what the user compares between the two Macs
    again = _cli(["key", "import", line.strip()], mac2)  # as an argument, the same key: fine
    assert again.returncode == 0 and "already had" in again.stdout


def test_import_refuses_a_typo_and_another_fleets_key_without_force(two_macs):
    key, mac1, mac2, dest = two_macs
    line = _cli(["key", "export"], mac1).stdout.strip()
    typo = line[:30] + ("1" if line[30] == "0" else "0") + line[31:]
    bad = _cli(["key", "import", typo], mac2)
    assert bad.returncode == 2 and "checksum" in bad.stderr and not dest.exists()
    bad = _cli(["key", "import", line[:-3]], mac2)
    assert bad.returncode == 2 and "truncated" in bad.stderr and not dest.exists()
    other = keys.keygen(dest)
    refused = _cli(["key", "import", line], mac2)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert keys.load_key(dest) == other
    forced = _cli(["key", "import", "--force"], mac2, stdin=line + "\n")
    assert forced.returncode == 0, forced.stderr
    assert keys.load_key(dest) == key


def test_a_world_readable_key_is_refused_with_the_fix(two_macs):
    key, mac1, mac2, dest = two_macs
    (dest.parent.parent / "mac1" / "fleet.key").chmod(0o644)
    out = _cli(["key", "export"], mac1)
    assert out.returncode == 2 and "chmod 600" in out.stderr and not out.stdout


def test_keygen_still_writes_a_key_export_can_read(tmp_path):
    env = dict(os.environ, MACFLEET_HOME=str(tmp_path), MACFLEET_NO_OPENBLAS="1")
    env.pop("MACFLEET_KEY", None)
    assert _cli(["keygen"], env).returncode == 0
    out = _cli(["key", "export"], env)
    assert keys.parse_line(out.stdout) == keys.load_key(tmp_path / "fleet.key")
    env["MACFLEET_KEY"] = str(tmp_path / "elsewhere.key")  # $MACFLEET_KEY names the file
    assert _cli(["key", "import", out.stdout.strip()], env).returncode == 0
    assert keys.load_key(tmp_path / "elsewhere.key") == keys.load_key(tmp_path / "fleet.key")
