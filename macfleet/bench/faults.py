"""Fault figures for `macfleet bench security`: live agent processes stopped or killed in the
middle of a generation, and how long the client takes to hear of it.

- verifier SIGSTOP (a Mac asleep): the client's silence deadline (3 s after the verifier's last
  message or heartbeat) raises; after SIGCONT the verifier serves again;
- proposer SIGKILL mid-stream: the generation completes, ids equal to the verifier alone (the
  verifier waits out one draft deadline, `longest_stall_s`, then decodes alone);
- verifier SIGKILL: the client raises within the silence deadline, tokens received kept.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

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
