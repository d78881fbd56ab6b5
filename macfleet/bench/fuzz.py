"""A fuzz campaign against live agents, as figures (`macfleet bench security`).

A verifier and a proposer agent run as separate processes (closed fleet, tiny model). Each door
gets hostile traffic by category; after every category the agent must still answer a ping
within `HANG_S` (else a hang) and its process must be alive (else a crash). Every reply must be
a typed ErrorReply (its code counted) or a valid message. RSS of each agent process is read from
/proc before and after. Peers without the key (plain ZeroMQ, a wrong CURVE key, 2,000 idle TCP
connections) must get nothing, and the agent must keep serving key holders meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import zmq

from bridge import auth, codec
from bridge.card import PROTOCOL_VERSION
from bridge.errors import CODES, BUSY
from bridge.messages import ErrorReply, OpenSession, Ping, Pong, SessionOpened, example, registry
from bridge.transport import Client
from macfleet.bench.watch import HANG_S, fd_limit, rss_mib
from macfleet.fleet.keys import keygen

DRAIN_QUIET_S = 0.3
IDLE_CONNECTIONS = 2000
TAGS = sorted(registry())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_agents(tmp: Path) -> Iterator[tuple[bytes, dict[str, tuple[str, subprocess.Popen]]]]:
    key_path = tmp / "fleet.key"
    key = keygen(key_path)
    env = {**os.environ, "MACFLEET_HOME": str(tmp)}
    out: dict[str, tuple[str, subprocess.Popen]] = {}
    logs = []
    try:
        for role in ("verifier", "proposer"):
            port = _free_port()
            log = open(tmp / f"{role}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            p = subprocess.Popen([sys.executable, "-m", "macfleet", "agent", "--role", role,
                                  "--model", "tiny:1", "--loopback", "--name", f"fuzz-{role}",
                                  "--port", str(port), "--key", str(key_path)],
                                 env=env, stdout=log, stderr=subprocess.STDOUT)
            out[role] = (f"tcp://127.0.0.1:{port}", p)
        from macfleet.bench.f3 import wait_ready

        for endpoint, _ in out.values():
            wait_ready(endpoint, key)
        yield key, out
    finally:
        for _, p in out.values():
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for log in logs:
            log.close()


# --- hostile messages (pure builders: rng -> frames) --------------------------------------------


def _hdr(rng: random.Random, **over) -> bytes:
    h = {"v": PROTOCOL_VERSION, "type": "ping", "id": f"f{rng.getrandbits(48):x}", "session": "",
         "reply_to": None, "t_ns": time.time_ns()}
    h.update(over)
    return msgpack.packb(h)


def _array_msg(rng: random.Random, dtype: str, shape: list, nbytes: int) -> list[bytes]:
    desc = {"__frame__": 0, "dtype": dtype, "shape": shape}
    body = msgpack.packb({"session_id": "s", "block": 0, "positions": [0], "states": desc})
    return [_hdr(rng, type="hidden_states"), body, bytes(nbytes)]


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # fixarray(1) ... nil


CATEGORIES: dict[str, Callable[[random.Random], list[bytes]]] = {
    "random_frames": lambda r: [r.randbytes(r.randint(0, 64)) for _ in range(r.randint(1, 5))],
    "wrong_types": lambda r: [_hdr(r, type=r.choice(TAGS)), msgpack.packb(
        {r.choice(["seq", "prompt", "k", "session_id", "x"]): r.choice(
            [None, "s", -1, 2**63, 1.5, [1, "a"], {"a": 1}, b"\xff"]) for _ in range(4)})],
    "huge_shapes": lambda r: _array_msg(r, "float16", [2**31, 2**31], 64),
    "negative_dims": lambda r: _array_msg(r, "float32", [-1, r.randint(1, 8)], 32),
    "object_dtypes": lambda r: _array_msg(r, r.choice(["object", "O", "|O", "V8", "<U4"]),
                                          [2], 16),
    "truncated_buffers": lambda r: _array_msg(r, "float32", [16, 16], r.randint(0, 1023)),
    "deep_nesting": lambda r: [_hdr(r), _nested(r.choice([100, 1000, 10000, 100000]))],
    "wrong_version": lambda r: [_hdr(r, v=r.choice([0, PROTOCOL_VERSION + 1, 99,
                                                    str(PROTOCOL_VERSION), None])),
                                msgpack.packb({"seq": 1, "sent_ns": 2})],
    "unknown_types": lambda r: [_hdr(r, type=f"t{r.random()}"), b"\x80"],
    "valid_any_type": lambda r: [bytes(f) for f in codec.encode(
        example(registry()[r.choice(TAGS)], seed=r.randint(0, 5)))],
}


class Probe:
    """A DEALER for hand-made frames (CURVE with `curve_key`, none, or a wrong one); counts
    typed replies."""

    def __init__(self, endpoint: str, curve_key: bytes | None, *,
                 server_public: bytes | None = None) -> None:
        """server_public: CURVE with the server public key given and a client keypair of the
        probe's own (a peer that learnt the server key but holds no fleet client key)."""
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 2000)
        if server_public is not None:
            public, secret = zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        else:
            auth.apply_curve(self.sock, curve_key, server=False)
        self.sock.connect(endpoint)
        self.replies: Counter[str] = Counter()
        self.untyped = 0

    def send(self, frames: list[bytes]) -> bool:
        try:
            self.sock.send_multipart(frames)
            return True
        except zmq.Again:
            return False

    def drain(self, quiet_s: float = DRAIN_QUIET_S) -> None:
        while self.sock.poll(int(quiet_s * 1000), zmq.POLLIN):
            parts = self.sock.recv_multipart()
            try:
                msg = codec.decode(parts).msg
            except Exception:  # noqa: BLE001 - an undecodable reply is what we count
                self.untyped += 1
                continue
            if isinstance(msg, ErrorReply):
                self.replies[msg.code if msg.code in CODES else "untyped"] += 1
            else:
                self.replies[type(msg).__name__] += 1

    def close(self) -> None:
        self.sock.close(linger=0)


def _alive(endpoint: str, key: bytes, proc: subprocess.Popen) -> tuple[bool, bool]:
    """(crashed, hung)."""
    if proc.poll() is not None:
        return True, False
    try:
        with Client(endpoint, key=key, connect_timeout_s=HANG_S) as c:
            return False, not isinstance(c.request(Ping(1, 0), HANG_S), Pong)
    except Exception:  # noqa: BLE001 - any failure to answer is a hang here
        return proc.poll() is not None, proc.poll() is None


def fuzz_door(endpoint: str, proc: subprocess.Popen, key: bytes, per_category: int,
              rng: random.Random, progress: Callable[[str], None]) -> dict:
    cats: dict[str, dict] = {}
    crashes = hangs = sent = 0
    rss0 = rss_mib(proc.pid)
    for name, build in CATEGORIES.items():
        p = Probe(endpoint, key)
        n = 0
        for _ in range(per_category):
            n += p.send(build(rng))
        p.drain()
        p.close()
        c, h = _alive(endpoint, key, proc)
        crashes, hangs, sent = crashes + c, hangs + h, sent + n
        cats[name] = {"messages": n, "replies": dict(p.replies), "untyped": p.untyped,
                      "crash": c, "hang": h}
    cats.update(_replays_and_clocks(endpoint, key, rng, per_category))
    for extra in ("replays", "stale_future"):
        sent += cats[extra]["messages"]
    c, h = _alive(endpoint, key, proc)
    crashes, hangs = crashes + c, hangs + h
    cats["no_key_peers"] = _no_key(endpoint, key, rng, per_category)
    sent += cats["no_key_peers"]["messages"]
    progress(f"  {endpoint}: {sent} messages, crashes {crashes}, hangs {hangs}")
    return {"messages": sent, "crashes": crashes, "hangs": hangs, "rss_before_mib": rss0,
            "rss_after_mib": rss_mib(proc.pid), "categories": cats,
            "refusals": dict(sum((Counter(v.get("replies", {})) for v in cats.values()),
                                 Counter()))}


def _replays_and_clocks(endpoint: str, key: bytes, rng: random.Random, n: int) -> dict:
    """A key holder re-sending the same frames, or with clocks far off: served, not refused
    (only key holders reach the agent through CURVE; an outsider cannot replay into it)."""
    out = {}
    p = Probe(endpoint, key)
    frames = [bytes(f) for f in codec.encode(Ping(1, 0))]
    for _ in range(n):
        p.send(frames)
    p.drain()
    out["replays"] = {"messages": n, "replies": dict(p.replies)}
    p.replies = Counter()
    skew = 10**9 * 3600
    for _ in range(n):
        t = time.time_ns() + rng.choice([-skew, skew, -10 * skew, 2**62])
        p.send([bytes(f) for f in codec.encode(Ping(2, 0), t_ns=max(0, t))])
    p.drain()
    out["stale_future"] = {"messages": n, "replies": dict(p.replies)}
    p.close()
    return out


def _no_key(endpoint: str, key: bytes, rng: random.Random, n: int) -> dict:
    """Plain ZeroMQ and a wrong CURVE key: nothing must come back."""
    got = sent = 0
    for curve in (None, rng.randbytes(32)):
        p = Probe(endpoint, curve)
        for _ in range(n):
            sent += p.send([bytes(f) for f in codec.encode(Ping(4, 0))])
        p.drain(1.0)
        got += sum(p.replies.values()) + p.untyped
        p.close()
    return {"messages": 2 * n, "queued_by_zmq": sent, "replies": {}, "answered": got}


def _other_address() -> str | None:
    """A second loopback address to play the honest client from (Linux routes all of 127/8
    to lo; macOS has only 127.0.0.1 unless aliased)."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return None


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        while s.recv(65536):  # libzmq's greeting, if any
            pass
        return False  # end of stream: closed by the agent
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


def idle_flood(endpoint: str, key: bytes, proc: subprocess.Popen, n: int) -> dict:
    """n idle TCP connections at once from one address: the agent keeps at most its pending
    budget (bridge.peercap: connections within their handshake's time are kept past the
    per-address cap, within the budget of its descriptor limit) and closes the rest as they
    arrive, keeps serving a key holder (from another address when there is one), then sheds
    the kept ones at CURVE's handshake deadline."""
    from bridge.peercap import DEFAULT_MAX_PER_PEER, caps_for

    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    conns = []
    opened_err = ""
    t_open = time.monotonic()
    for _ in range(n):
        try:
            conns.append(socket.create_connection((host, int(port)), timeout=2))
        except OSError as e:  # our own fd limit, not the agent's
            opened_err = str(e)
            break
    open_s = time.monotonic() - t_open
    time.sleep(0.5)  # well inside the handshake deadline: what is closed now, the cap closed
    kept = sum(_still_open(s) for s in conns)
    other = _other_address()
    ping_ep = f"tcp://{other}:0;{host}:{port}" if other else endpoint
    t0 = time.monotonic()
    crashed, hung = _alive(ping_ep, key, proc)
    ping_ms = round((time.monotonic() - t0) * 1e3, 1)
    time.sleep(auth.DEFAULT_HANDSHAKE_S + 1.0)
    shed = sum(not _still_open(s) for s in conns)
    for s in conns:
        s.close()
    return {"connections": len(conns), "open_error": opened_err, "open_s": round(open_s, 2),
            "cap_per_address": DEFAULT_MAX_PER_PEER, "kept_from_one_address": kept,
            "agent_fd_limit": fd_limit(proc.pid),
            "pending_budget": caps_for(fd_limit(proc.pid)).pending,
            "closed_at_once": len(conns) - kept,
            "summary": f"{len(conns)} connections from one address -> {kept} kept",
            "crash": crashed, "hang": hung, "ping_from": other or host,
            "ping_ms_during": ping_ms, "shed_after_handshake_deadline": shed}


def _open(sid: str) -> OpenSession:
    return OpenSession(session_id=sid, proposer="ngram", model="", prompt=[1, 2, 3],
                       temperature=0.0, top_p=1.0, seed=None, cross_round=False)


def session_exhaustion(endpoint: str, key: bytes, n: int) -> dict:
    """One client opens n sessions; a second client must still get one."""
    codes: Counter[str] = Counter()
    with Client(endpoint, key=key) as a:
        for i in range(n):
            try:
                r = a.request(_open(f"x{i}"), 10)
                codes[type(r).__name__] += 1
            except Exception as e:  # noqa: BLE001 - the typed code is the figure
                codes[getattr(e, "code", type(e).__name__)] += 1
    with Client(endpoint, key=key) as b:
        r = b.request(_open("other"), 10)
    return {"requests": n, "replies": dict(codes), "other_client_served":
            isinstance(r, SessionOpened), "busy": codes.get(BUSY, 0)}


def _faults(agents: dict, key: bytes, progress: Callable[[str], None]) -> dict:
    from macfleet.bench.faults import fault_cases, ring_cut

    progress("faults: verifier SIGSTOP, proposer SIGKILL, verifier SIGKILL mid-generation")
    out = fault_cases(agents["verifier"], agents["proposer"], key)
    out["ring_cut"] = ring_cut(progress)
    return out


def one_part(part: str, progress: Callable[[str], None] = lambda m: None) -> dict:
    """Re-measure one part of the campaign on fresh agents: "faults" (the `faults` figures) or
    "flood" (the `idle_flood` figures)."""
    if part not in ("faults", "flood"):
        raise ValueError(f"unknown part {part!r}")
    with tempfile.TemporaryDirectory(prefix="macfleet-fuzz-") as tmp:
        with live_agents(Path(tmp)) as (key, agents):
            if part == "faults":
                return _faults(agents, key, progress)
            if part == "flood":
                progress(f"{IDLE_CONNECTIONS} idle connections to the verifier")
                endpoint, proc = agents["verifier"]
                return idle_flood(endpoint, key, proc, IDLE_CONNECTIONS)
    raise ValueError(f"unknown part {part!r}")


def campaign(*, messages: int = 3000, seed: int = 0,
             progress: Callable[[str], None] = lambda m: None) -> dict:
    rng = random.Random(seed)
    # per door: categories + replays + stale/future + two no-key peers
    per = max(1, messages // 2 // (len(CATEGORIES) + 4))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="macfleet-fuzz-") as tmp:
        with live_agents(Path(tmp)) as (key, agents):
            doors = {}
            for role, (endpoint, proc) in agents.items():
                progress(f"fuzzing the {role} agent ({per} messages per category)")
                doors[role] = fuzz_door(endpoint, proc, key, per, rng, progress)
            v_ep, v_proc = agents["verifier"]
            progress(f"{IDLE_CONNECTIONS} idle connections to the verifier")
            flood = idle_flood(v_ep, key, v_proc, IDLE_CONNECTIONS)
            p_ep, _ = agents["proposer"]
            progress("session exhaustion on the proposer")
            exhaustion = session_exhaustion(p_ep, key, 500)
            for role, (endpoint, proc) in agents.items():
                doors[role]["rss_end_mib"] = rss_mib(proc.pid)
            from macfleet.bench.fuzz_http import CATEGORIES as HTTP_CATEGORIES, http_door

            progress(f"fuzzing the HTTP API ({per} requests per category)")
            doors["http"] = http_door(max(1, per * (len(CATEGORIES) + 4) // len(HTTP_CATEGORIES)),
                                      rng, progress)
            faults = _faults(agents, key, progress)
    return {"what": "hostile traffic against live agent processes (closed fleet, tiny:1) and "
                    "a live HTTP API server (tiny:1, API key set)",
            "seed": seed, "wall_s": round(time.monotonic() - t0, 1), "doors": doors,
            "idle_flood": flood, "session_exhaustion": exhaustion, "faults": faults,
            "totals": {"messages": sum(d["messages"] for d in doors.values()),
                       "crashes": sum(d["crashes"] for d in doors.values()) + flood["crash"],
                       "hangs": sum(d["hangs"] for d in doors.values()) + flood["hang"]}}
