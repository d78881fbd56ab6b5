"""Fault figures for `macfleet bench security`: live agent processes stopped or killed in the
middle of a generation, and how long the client takes to hear of it.

- verifier SIGSTOP (a Mac asleep): the client's silence deadline (3 s after the verifier's last
  message or heartbeat) raises; after SIGCONT the verifier serves again;
- proposer SIGKILL mid-stream: the generation completes, ids equal to the verifier alone (the
  verifier waits out one draft deadline, `longest_stall_s`, then decodes alone);
- verifier SIGKILL: the client raises within the silence deadline, tokens received kept;
- ring link cut (`ring_cut`, in the network-namespace test bed of a source checkout: root and
  `ip netns`): a verifier sharded over two hosts loses the link between its ranks
  mid-generation; rank 0's ring watchdog answers the request in flight with a clear error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bridge.card import AgentCard
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import GenerateChunk, GenerateDone, Ping, Pong
from bridge.transport import Client
from macfleet.fleet.client import generate_remote

PROMPT = "the cat sat on the mat and the dog sat on the rug"


def _card(endpoint: str) -> AgentCard:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return AgentCard(node_id="bench", name="verifier", fleet_id="", host=host,
                     router_port=int(port), pub_port=0, roles=("verifier",))


def run_with_fault(verifier: str, key: bytes, act: Callable[[], None], *,
                   proposers: Sequence[str] = (), spec: str = "none",
                   max_tokens: int = 4000) -> dict:
    """Generate; call act() after the first chunk; the outcome and seconds from act to it."""
    ids: list[int] = []
    acted = None
    out: dict = {}
    last, gap = 0.0, 0.0  # the longest wait between two chunks after the fault
    try:
        for m in generate_remote(_card(verifier), key, prompt=PROMPT, chat=False,
                                 max_tokens=max_tokens, proposers=list(proposers),
                                 proposer_spec=spec, draft_tokens=2):
            if isinstance(m, GenerateChunk):
                ids += m.token_ids
                now = time.monotonic()
                if acted is None:
                    act()
                    acted = last = time.monotonic()
                gap, last = max(gap, now - last), now
            elif isinstance(m, GenerateDone):
                out = {"outcome": "completed", "token_ids": list(m.token_ids)}
    except (TransportTimeout, PeerUnavailable, ProtocolError) as e:
        out = {"outcome": f"error: {type(e).__name__}: {e}"}
    out.update(seconds_after_fault=round(time.monotonic() - (acted or time.monotonic()), 2),
               longest_stall_s=round(gap, 2), tokens_received=len(ids), acted=acted is not None)
    return out


def _serves(endpoint: str, key: bytes) -> bool:
    try:
        with Client(endpoint, key=key, connect_timeout_s=5) as c:
            return isinstance(c.request(Ping(1, 0), 5), Pong)
    except (TransportTimeout, PeerUnavailable, ProtocolError):
        return False


def fault_cases(verifier: tuple[str, subprocess.Popen], proposer: tuple[str, subprocess.Popen],
                key: bytes) -> dict:
    (v_ep, v_proc), (p_ep, p_proc) = verifier, proposer
    out = {}
    stop = run_with_fault(v_ep, key, lambda: os.kill(v_proc.pid, signal.SIGSTOP))
    os.kill(v_proc.pid, signal.SIGCONT)
    time.sleep(0.5)
    stop["serves_after_sigcont"] = _serves(v_ep, key)
    out["verifier_sigstop"] = stop
    alone = run_with_fault(v_ep, key, lambda: None, max_tokens=300)
    kill_p = run_with_fault(v_ep, key, lambda: p_proc.send_signal(signal.SIGKILL),
                            proposers=[p_ep], spec="ngram", max_tokens=300)
    kill_p["identical_to_verifier_alone"] = (kill_p.get("token_ids") == alone.get("token_ids")
                                             and "token_ids" in alone)
    out["proposer_sigkill"] = kill_p
    out["verifier_sigkill"] = run_with_fault(v_ep, key, lambda: v_proc.send_signal(signal.SIGKILL))
    for case in out.values():
        case.pop("token_ids", None)
    return out


RING_SUBNET = "10.197.0"  # not the tests' test beds' subnets: both may run at once
RING_UP_S = 150.0  # two shard agents load, form the ring and advertise
RING_UNCUT_TOKENS = 128
RING_CUT_AFTER_TOKENS = 16


def ring_cut(progress: Callable[[str], None] = lambda m: None, *,
             cut_after_tokens: int = RING_CUT_AFTER_TOKENS) -> dict:
    """A verifier sharded over two test-bed hosts (pipeline, tiny:1), the link of rank 1 cut at
    the bridge once `cut_after_tokens` tokens arrived: seconds from the cut to the client's error, and the tokens
    received before it (checked against an uncut run's prefix). A dict with `skipped` (why)
    where the test bed cannot be made."""
    from macfleet.bench.f3 import load_testbed
    from macfleet.fleet.keys import keygen

    netns, why = load_testbed()
    if why:
        return {"skipped": f"multi-host test bed unavailable: {why}"}
    client = str(Path(netns.__file__).with_name("fleet_client.py"))
    with tempfile.TemporaryDirectory(prefix="macfleet-ringcut-") as tmp, \
            netns.Testbed(3, subnet=RING_SUBNET, tag=f"rc{os.getpid() % 10000}") as tb:
        key_path = str(Path(tmp) / "fleet.key")
        keygen(Path(key_path))
        r0, r1, c = tb.hosts
        for host, rank in ((r0, 0), (r1, 1)):
            with open(Path(tmp) / f"rank{rank}.log", "wb") as log:
                tb.popen(host, [sys.executable, "-m", "macfleet", "agent", "--role", "shard",
                                "--group", "g", "--group-size", "2", "--rank", str(rank),
                                "--shard-mode", "pipeline", "--model", "tiny:1", "--name",
                                f"shard-{rank}", "--bind", host.ip, "--key", key_path],
                         stdout=log, stderr=subprocess.STDOUT)

        def run(*args: str, timeout: float = 120) -> list[dict]:
            r = tb.run(c, [sys.executable, client, *args, "--key", key_path], timeout=timeout)
            return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]

        progress("ring cut: waiting for the sharded verifier (2 ranks in namespaces)")
        deadline = time.monotonic() + RING_UP_S
        while not any("verifier" in card["roles"] for card in
                      (run("discover", "--expect", "2", "--wait", "5") or [[]])[0]):
            if time.monotonic() > deadline:
                logs = {p.name: p.read_text(errors="replace")[-500:]
                        for p in Path(tmp).glob("*.log")}
                return {"outcome": "error: the sharded verifier never came up", "logs": logs}
            time.sleep(1)
        uncut = run("generate", "--alone", "--max-tokens", str(RING_UNCUT_TOKENS), "--expect", "2")
        uncut_ids = uncut[-1].get("done", []) if uncut else []
        progress(f"ring cut: generating, cutting rank 1's link after {cut_after_tokens} tokens")
        proc = tb.popen(c, [sys.executable, client, "generate", "--alone", "--max-tokens", "4000",
                            "--expect", "2", "--key", key_path],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines, at, cut_at, hang, got, got_at_cut = [], [], None, False, 0, 0
        try:
            for line in proc.stdout:
                lines.append(json.loads(line))
                at.append(time.monotonic())
                got += len(lines[-1].get("chunk", []))
                if cut_at is None and got >= cut_after_tokens:
                    tb.set_link(r1, up=False)
                    cut_at, got_at_cut = time.monotonic(), got
            try:
                status = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                status, hang = proc.wait(5), True
        finally:
            tb.set_link(r1, up=True)
    ids = [t for m in lines for t in m.get("chunk", [])]
    last = lines[-1] if lines else {}
    n = min(len(ids), len(uncut_ids))
    return {"what": "verifier sharded over 2 namespace hosts (pipeline, tiny:1), rank 1's link "
                    f"cut at the bridge after {cut_after_tokens} tokens; client in a third host",
            "outcome": (f"error: {last['error']}" if "error" in last else
                        "completed" if "done" in last else f"no answer (exit {status})"),
            "exit_status": status, "hang": hang, "acted": cut_at is not None,
            "seconds_after_fault": round(at[-1] - cut_at, 2) if cut_at and at else None,
            "silence_before_error_s": round(at[-1] - at[-2], 2) if len(at) > 1 else None,
            "tokens_received": len(ids), "tokens_at_cut": got_at_cut,
            "tokens_match_uncut_prefix": bool(uncut_ids) and ids[:n] == uncut_ids[:n],
            "uncut_tokens": len(uncut_ids)}
