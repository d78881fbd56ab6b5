"""A verifier sharded over two hosts (network namespaces), its ring link cut mid-generation:
the client gets a clear error within seconds, never a hang. (Rank kills are covered on
loopback in tests/integration/test_shard_agents.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from macfleet.fleet.keys import keygen


sys.path.insert(0, str(Path(__file__).parent))
import netns  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(300)]

MODEL = "tiny:1"
CLIENT = str(Path(__file__).parent / "fleet_client.py")
REASON = netns.available()


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    if REASON:
        pytest.skip(f"multi-host test bed unavailable: {REASON}")
    tmp = tmp_path_factory.mktemp("shardbed")
    key_path = tmp / "fleet.key"
    keygen(key_path)
    with netns.Testbed(3, subnet="10.198.0", tag=f"s{__import__('os').getpid() % 10000}") as tb:
        r0, r1, c = tb.hosts
        for host, rank in ((r0, 0), (r1, 1)):
            log = open(tmp / f"rank{rank}.log", "wb")
            tb.popen(host, [sys.executable, "-m", "macfleet", "agent", "--role", "shard",
                            "--group", "g", "--group-size", "2", "--rank", str(rank),
                            "--shard-mode", "pipeline", "--model", MODEL, "--name",
                            f"shard-{rank}", "--bind", host.ip, "--key", str(key_path)],
                     stdout=log, stderr=subprocess.STDOUT)
        yield {"tb": tb, "key_path": str(key_path), "r0": r0, "r1": r1, "c": c, "tmp": tmp}


def run_client(bed, *args: str, timeout: float = 120) -> list[dict]:
    r = bed["tb"].run(bed["c"], [sys.executable, CLIENT, *args, "--key", bed["key_path"]],
                      timeout=timeout)
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def wait_for_verifier(bed, timeout_s: float = 150) -> None:
    """Until rank 0's card says `verifier` (its ring is up): one client watching."""
    cards = run_client(bed, "discover", "--role", "verifier", "--wait", str(timeout_s),
                       timeout=timeout_s + 30)
    if cards and any("verifier" in c["roles"] for c in cards[0]):
        return
    logs = {p.name: p.read_text(errors="replace")[-1500:] for p in bed["tmp"].glob("*.log")}
    pytest.fail(f"the sharded verifier never came up: {logs}")


def test_ring_link_cut_mid_generation_is_a_clear_error_not_a_hang(bed):
    wait_for_verifier(bed)
    alone = run_client(bed, "generate", "--alone", "--max-tokens", "16", "--expect", "2")
    assert "done" in alone[-1], alone
    tb = bed["tb"]
    proc = tb.popen(bed["c"], [sys.executable, CLIENT, "generate", "--alone", "--max-tokens",
                               "4000", "--expect", "2", "--key", bed["key_path"]],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, at, cut_at = [], [], None
    try:
        for line in proc.stdout:
            lines.append(json.loads(line))
            at.append(time.monotonic())
            if cut_at is None and "chunk" in lines[-1]:
                tb.set_link(bed["r1"], up=False)  # the ring between the two ranks is cut
                cut_at = time.monotonic()
        status = proc.wait(60)
    finally:
        tb.set_link(bed["r1"], up=True)
    assert cut_at is not None, proc.stderr.read()[-3000:]
    assert status == 3 and "error" in lines[-1], lines[-1]
    # the error comes within the silence deadline (3 s) of the last message the verifier got
    # out (tokens already in flight when the link went down still arrive first), never a hang
    silent = at[-1] - (at[-2] if len(at) > 1 else cut_at)
    assert silent < 3.0 + 1.0, (silent, at[-1] - cut_at, lines[-1])
    # rank 0's ring watchdog (3 s) answers the request in flight with `unavailable`
    assert at[-1] - cut_at < 3.0 + 1.5 and "unavailable" in lines[-1]["error"], lines[-1]
    print(f"ring cut: {lines[-1]} after {at[-1] - cut_at:.2f}s")
