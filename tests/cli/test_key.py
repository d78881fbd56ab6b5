"""`macfleet key export | macfleet key import`: the key crosses to another Mac as one line and
lands private; a bad line or another fleet's key file changes nothing. In-process through the
CLI's own main() (two MACFLEET_HOMEs for two Macs), and once through a real shell pipe."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys

import pytest

from macfleet.cli.main import main
from macfleet.fleet import keys

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def macs(tmp_path, monkeypatch, capsys):
    """cli(mac, *args, stdin=None) -> (rc, stdout, stderr) with mac's MACFLEET_HOME."""
    monkeypatch.delenv("MACFLEET_KEY", raising=False)

    def cli(mac, *args, stdin=None):
        monkeypatch.setenv("MACFLEET_HOME", str(tmp_path / mac))
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        return rc, out.out, out.err

    key = keys.keygen(tmp_path / "mac1" / "fleet.key")
    return cli, key, tmp_path / "mac2" / "fleet.key"


def test_export_then_import_from_stdin(macs):
    cli, key, dest = macs
    rc, line, err = cli("mac1", "key", "export")
    assert rc == 0
    assert line.count("\n") == 1 and line.startswith("macfleet-key-v1:")  # only the line
    fid = err.split("fleet id ")[1].split(";")[0]
    rc, out, _ = cli("mac2", "key", "import", stdin=line)  # no LINE: read from stdin
    assert rc == 0 and keys.load_key(dest) == key
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert f"fleet id {fid}" in out  # what the user compares between the two Macs
    rc, out, _ = cli("mac2", "key", "import", line.strip())  # as an argument, the same key
    assert rc == 0 and "already had" in out


def test_import_refuses_a_typo_and_another_fleets_key_without_force(macs):
    cli, key, dest = macs
    line = cli("mac1", "key", "export")[1].strip()
    typo = line[:30] + ("1" if line[30] == "0" else "0") + line[31:]
    rc, _, err = cli("mac2", "key", "import", typo)
    assert rc == 2 and "checksum" in err and not dest.exists()
    rc, _, err = cli("mac2", "key", "import", line[:-3])
    assert rc == 2 and "truncated" in err and not dest.exists()
    other = keys.keygen(dest)
    rc, _, err = cli("mac2", "key", "import", line)
    assert rc == 2 and "--force" in err and keys.load_key(dest) == other
    rc, _, err = cli("mac2", "key", "import", "--force", stdin=line + "\n")
    assert rc == 0, err
    assert keys.load_key(dest) == key


def test_a_world_readable_key_is_refused_with_the_fix(macs, tmp_path):
    cli, _, _ = macs
    (tmp_path / "mac1" / "fleet.key").chmod(0o644)
    rc, out, err = cli("mac1", "key", "export")
    assert rc == 2 and "chmod 600" in err and not out
    rc, out, err = cli("mac3", "key", "export")
    assert rc == 2 and "macfleet keygen" in err and "key import" in err


def test_keygen_still_writes_a_key_export_can_read(macs, tmp_path, monkeypatch):
    cli, _, _ = macs
    assert cli("mac3", "keygen")[0] == 0
    line = cli("mac3", "key", "export")[1]
    assert keys.parse_line(line) == keys.load_key(tmp_path / "mac3" / "fleet.key")
    monkeypatch.setenv("MACFLEET_KEY", str(tmp_path / "elsewhere.key"))  # $MACFLEET_KEY
    assert cli("mac3", "key", "import", line.strip())[0] == 0
    assert keys.load_key(tmp_path / "elsewhere.key") == keys.parse_line(line)


@pytest.mark.slow
def test_export_piped_into_import_in_real_processes(tmp_path):
    """The issue's round trip, as a shell runs it: `key export | key import --force`."""
    key = keys.keygen(tmp_path / "mac1" / "fleet.key")
    keys.keygen(tmp_path / "mac2" / "fleet.key")  # another fleet's key: --force replaces it
    cmd = [sys.executable, "-m", "macfleet", "key"]
    env = dict(os.environ, MACFLEET_NO_OPENBLAS="1")
    env.pop("MACFLEET_KEY", None)
    export = subprocess.Popen([*cmd, "export"], stdout=subprocess.PIPE,
                              env=dict(env, MACFLEET_HOME=str(tmp_path / "mac1")))
    got = subprocess.run([*cmd, "import", "--force"], stdin=export.stdout, capture_output=True,
                         text=True, timeout=90, env=dict(env, MACFLEET_HOME=str(tmp_path / "mac2")))
    export.stdout.close()
    assert export.wait(timeout=90) == 0
    assert got.returncode == 0, got.stderr
    assert keys.load_key(tmp_path / "mac2" / "fleet.key") == key
