"""The closed fleet's second pass (issue 31), as figures: five attacks on a fresh `macfleet up`.

A local fleet (a verifier and a proposer agent process, closed, tiny model) is started the way a
user starts one; each case runs a bounded attack (seconds) while a key holder pings the agent
under attack on a fresh connection every `PING_EVERY_S` (success and latency are the figures),
and ends with a generation through the proposer (does it still get remote drafts?):

1. ssrf: a GenerateRequest naming a plain listener on another loopback address as its proposer,
   and a link probe naming it: the error codes, and whether the listener saw a connection;
2. slots: six connections open every drafting slot of the proposer and keep them busy with
   keep-alive drafts: how many they took, and the generation's remote blocks meanwhile;
3. ownership: a second connection drafts on, re-opens and closes the first one's session;
4. churn: keyless connections opened and closed as fast as a thread can, from the key holder's
   own address, then from 100 addresses: connections held (descriptors of the agent process)
   against its descriptor limit;
5. rogue_client: a peer with the server public key but its own client keypair sends a ping.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from bridge import auth, codec
from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER, AgentCard
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import (CloseSession, DraftRequest, OpenSession, Ping, RunPreset,
                             SessionOpened, StatusReply, StatusRequest)
from bridge.transport import Client
from macfleet.bench.watch import fd_limit, open_fds
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote
from macfleet.fleet.keys import keygen

FLOOD_S = 3.0  # each attack lasts this long
PING_EVERY_S = 0.2
SLOT_CONNECTIONS = 6
CHURN_HOLD = 192  # keyless connections one address keeps open at a time (3x the cap)
CHURN_ADDRESSES = 100
PROMPT = "the quick brown fox"
DRAFT_TOKENS = 4  # fixed: every block asks the proposer (auto shrinks to 0 on a random model)


def _ping_ms(endpoint: str, key: bytes, seq: int) -> float | None:
    """One ping on a fresh connection (a new client): ms, None when it failed."""
    t = time.perf_counter()
    try:
        with Client(endpoint, key=key, connect_timeout_s=2.0) as c:
            c.request(Ping(seq, 0), 2.0)
    except (PeerUnavailable, TransportTimeout, ProtocolError):
        return None
    return round((time.perf_counter() - t) * 1e3, 2)


@contextlib.contextmanager
def _pinging(endpoint: str, key: bytes) -> Iterator[dict]:
    """Key-holder pings every PING_EVERY_S while the block runs; fills the dict after."""
    out: dict = {}
    stop = threading.Event()
    got: list[float | None] = []

    def run() -> None:
        while not stop.is_set():
            got.append(_ping_ms(endpoint, key, len(got)))
            stop.wait(PING_EVERY_S)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join(10)
        ok = [ms for ms in got if ms is not None]
        out.update(pings=len(got), ping_success=round(len(ok) / max(len(got), 1), 3),
                   ping_ms_median=round(statistics.median(ok), 2) if ok else None,
                   ping_ms_max=max(ok) if ok else None)


def _generate(verifier: AgentCard, key: bytes, proposer: str) -> dict:
    """A generation through the proposer: its remote blocks and proposer failures."""
    try:
        done = list(generate_remote(verifier, key, prompt=PROMPT, chat=False, max_tokens=24,
                                    proposers=[proposer], proposer_spec="ngram",
                                    draft_tokens=DRAFT_TOKENS))[-1]
    except (ProtocolError, TransportTimeout, PeerUnavailable) as e:
        return {"generate": f"error: {e}"}
    f = done.stats.fleet
    return {"generate": "ok", "tokens": len(done.token_ids),
            "remote_blocks": f.flows.remote_blocks, "proposer_failures": f.proposer_failures}


def _code(fn: Callable[[], object]) -> str:
    try:
        r = fn()
    except ProtocolError as e:
        return e.code
    except (TransportTimeout, PeerUnavailable) as e:
        return type(e).__name__
    return type(r).__name__


def _open(sid: str) -> OpenSession:
    return OpenSession(sid, "ngram", "", [1, 2, 3], 0.0, 1.0, None, False)


def ssrf(v: AgentCard, p: AgentCard, key: bytes) -> dict:
    lsock = socket.create_server(("127.0.0.2", 0))
    lsock.setblocking(False)
    target = f"tcp://127.0.0.2:{lsock.getsockname()[1]}"
    try:
        with _pinging(v.router_endpoint, key) as pings:
            gen = _code(lambda: list(generate_remote(v, key, prompt=PROMPT, chat=False,
                                                     max_tokens=4, proposers=[target])))
            with Client(p.router_endpoint, key=key) as c:
                probe = _code(lambda: c.request(RunPreset("link_probe", {"peer": target,
                                                                         "repeats": 1}), 10))
            time.sleep(0.5)
        seen = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                lsock.accept()[0].close()
                seen += 1
    finally:
        lsock.close()
    return {"target": target, "generate_reply": gen, "link_probe_reply": probe,
            "connections_to_target": seen, **pings}


def slots(v: AgentCard, p: AgentCard, key: bytes) -> dict:
    stop = threading.Event()
    opened: Counter[str] = Counter()
    lost: Counter[str] = Counter()

    def hog(n: int) -> None:
        with Client(p.router_endpoint, key=key) as c:
            mine = []
            for i in range(4):  # the per-client cap
                code = _code(lambda: c.request(_open(f"hog{n}-{i}"), 10))
                opened[code] += 1
                if code == "SessionOpened":
                    mine.append(f"hog{n}-{i}")
            block = 0
            while not stop.is_set():
                block += 1
                for sid in mine:
                    code = _code(lambda: c.request(DraftRequest(sid, block, [], 1, False), 5))
                    if code != "DraftReply":
                        lost[code] += 1
                stop.wait(0.02)

    hogs = [threading.Thread(target=hog, args=(n,), daemon=True) for n in range(SLOT_CONNECTIONS)]
    for t in hogs:
        t.start()
    time.sleep(1.0)
    with Client(p.router_endpoint, key=key) as c:
        status = c.request(StatusRequest(), 5)
    held = status.sessions if isinstance(status, StatusReply) else -1
    with _pinging(p.router_endpoint, key) as pings:
        gen = _generate(v, key, p.router_endpoint)
        time.sleep(max(0.0, FLOOD_S - 2.0))
    stop.set()
    for t in hogs:
        t.join(10)
    return {"connections": SLOT_CONNECTIONS, "opens": dict(opened),
            "slots_taken_by_them": held, "their_drafts_refused_after": dict(lost),
            **gen, **pings}


def ownership(p: AgentCard, key: bytes) -> dict:
    with Client(p.router_endpoint, key=key) as owner, Client(p.router_endpoint, key=key) as other:
        owner.request(_open("owned"), 10)
        out = {"draft_by_other": _code(lambda: other.request(
                   DraftRequest("owned", 1, [4], 2, False), 5)),
               "reopen_by_other": _code(lambda: other.request(_open("owned"), 10)),
               "close_by_other": _code(lambda: other.request(CloseSession("owned"), 5)),
               "owner_draft_after": _code(lambda: owner.request(
                   DraftRequest("owned", 1, [4], 2, False), 5))}
        owner.request(CloseSession("owned"), 5)
    return out


def _churn(port: int, sources: list[str], hold: int, stop: threading.Event,
           stats: Counter[str]) -> None:
    held: list[socket.socket] = []
    i = 0
    while not stop.is_set():
        try:
            held.append(socket.create_connection(
                ("127.0.0.1", port), timeout=1, source_address=(sources[i % len(sources)], 0)))
            stats["opened"] += 1
        except OSError:
            stats["open_failed"] += 1
        i += 1
        if len(held) > hold:
            held.pop(0).close()
    for s in held:
        s.close()


def churn(v: AgentCard, key: bytes, pid: int, sources: list[str], hold: int) -> dict:
    stop = threading.Event()
    stats: Counter[str] = Counter()
    fds_before = open_fds(pid)
    t = threading.Thread(target=_churn, args=(v.router_port, sources, hold, stop, stats),
                         daemon=True)
    with _pinging(v.router_endpoint, key) as pings:
        t.start()
        peak = fds_before
        deadline = time.monotonic() + FLOOD_S
        while time.monotonic() < deadline:
            peak = max(peak, open_fds(pid))
            time.sleep(0.05)
        stop.set()
        t.join(10)
    return {"addresses": len(sources), "held_by_flood": hold, "opened": stats["opened"],
            "open_failed": stats["open_failed"], "agent_fds_before": fds_before,
            "agent_fds_peak": peak, "agent_fd_limit": fd_limit(pid), **pings}


def rogue_client(v: AgentCard, key: bytes) -> dict:
    from macfleet.bench.fuzz import Probe

    with _pinging(v.router_endpoint, key) as pings:
        probe = Probe(v.router_endpoint, None, server_public=auth.curve_keys(key).server_public)
        sent = sum(probe.send([bytes(f) for f in codec.encode(Ping(i, 0))]) for i in range(5))
        probe.drain(1.5)
        answered = sum(probe.replies.values()) + probe.untyped
        probe.close()
    return {"pings_sent": sent, "answered": answered, **pings}


def closed_fleet(progress: Callable[[str], None] = lambda m: None) -> dict:
    """Every case against one fresh local fleet (tiny:1, closed)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="macfleet-closed-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        run_dir = Path(tmp) / "run"
        cards = local.up(2, model="tiny:1", key=key, key_path=key_path, run_dir=run_dir,
                         timeout_s=60)
        try:
            v = next(c for c in cards if ROLE_VERIFIER in c.roles)
            p = next(c for c in cards if ROLE_PROPOSER in c.roles)
            pid = {a.role: a.pid for a in local.read_state(run_dir)}
            out: dict = {}
            progress("ssrf: a listener on 127.0.0.2 named as proposer and link-probe peer")
            out["ssrf"] = ssrf(v, p, key)
            progress(f"slots: {SLOT_CONNECTIONS} connections keep every drafting slot busy")
            out["slots"] = slots(v, p, key)
            progress("ownership: another connection drafts on, re-opens and closes a session")
            out["ownership"] = ownership(p, key)
            progress(f"churn: keyless connections from 127.0.0.1 ({FLOOD_S:.0f} s)")
            out["churn_one_address"] = churn(v, key, pid["verifier"], ["127.0.0.1"], CHURN_HOLD)
            sources = [f"127.0.{i // 250}.{i % 250 + 2}" for i in range(CHURN_ADDRESSES)]
            progress(f"churn: keyless connections from {len(sources)} addresses")
            out["churn_many_addresses"] = churn(v, key, pid["verifier"], sources, 4 * len(sources))
            progress("rogue client: the server public key and a keypair of its own")
            out["rogue_client"] = rogue_client(v, key)
            out["after"] = _generate(v, key, p.router_endpoint)
        finally:
            local.down(run_dir)
    return {"what": "five attacks on a fresh local fleet (macfleet up: verifier + proposer, "
                    "tiny:1, closed); a key holder pings the attacked agent on a fresh "
                    f"connection every {PING_EVERY_S} s during each",
            "flood_s": FLOOD_S, "wall_s": round(time.monotonic() - t0, 1), **out}
