"""`macfleet bench security` (and `bench f3 --encryption`): what the closed fleet costs.

Two proposer agents run as separate processes on loopback, one in an open fleet (`--open`: in
clear) and one in a closed fleet (CURVE, as shipped). The same HiddenStates -> HiddenStatesAck
round trip as `bench f3` is timed for payloads 1 KiB .. 16 MiB, the two agents alternating
request by request so both see the same machine noise. What a per-message HMAC-SHA256 would add
on top (sign + verify of the same frames, the scheme used before CURVE) is timed apart, in this
process: the figure behind dropping it (bridge/auth.py). Then the extra milliseconds are put
against a real block of the SmolLM2 fleet (results/fleet_spec.json when present) for the
payloads of each flow.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import hashlib
import hmac
import struct

import numpy as np

from bridge import auth, codec
from bridge.messages import HiddenStates, HiddenStatesAck
from bridge.transport import Client
from macfleet.fleet.keys import keygen
from macfleet.bench.f3 import DEFAULT_SIZES, FLOAT16_BYTES, Point, interp_loglog, percentile, wait_ready

DEFAULT_REPEATS = 10
DEFAULT_BLOCK_MS = 133.0  # SmolLM2 two-agent block on this CI box when no fleet result is found
SMOLLM2 = {"hidden": 576, "vocab": 49152, "layers": 30, "kv_heads": 3, "head_dim": 64}
MODES = ("open", "closed")


@dataclass(frozen=True)
class FlowPayload:
    flow: str
    what: str
    nbytes: int


def smollm2_flows(k: int = 4, prompt_tokens: int = 512) -> list[FlowPayload]:
    """Per-block payloads of each flow at SmolLM2 sizes (pure)."""
    s = SMOLLM2
    kv_per_token = s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * FLOAT16_BYTES
    return [
        FlowPayload("F1", "accepted token ids (measured bytes/block, bench fleet)", 231),
        FlowPayload("F2", "greedy draft ids (measured bytes/block, bench fleet)", 222),
        FlowPayload("F2", f"sampling: {k} draft ids + probs [k, vocab] float32", k * s["vocab"] * 4),
        FlowPayload("F3", "EAGLE hidden states, 4 accepted tokens, float16", 4 * s["hidden"] * 2),
        FlowPayload("KV", f"prefill KV cache of a {prompt_tokens}-token prompt, float16 (once)",
                    prompt_tokens * kv_per_token),
    ]


def block_ms_from(results: Path) -> tuple[float, str]:
    """ms per block of the SmolLM2 two-agent fleet measured by `bench fleet`, else a default."""
    import json

    path = results / "fleet_spec.json"
    try:
        doc = json.loads(path.read_text())
        m = doc["prompts"]["chat"]["methods"]["agents[ngram,no cross-round]"]
        return round(1000 * (1 + m["mean_accepted"]) / m["tokens_per_s"], 1), str(path)
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return DEFAULT_BLOCK_MS, "default (no results/fleet_spec.json)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def proposer_agents(tmp: Path) -> Iterator[dict[str, tuple[str, bytes | None]]]:
    """An open and a closed proposer agent (tiny model) as processes: mode -> (endpoint, key)."""
    key_path = tmp / "fleet.key"
    key = keygen(key_path)
    env = {**os.environ, "MACFLEET_HOME": str(tmp)}
    procs, out = [], {}
    try:
        for mode in MODES:
            port = _free_port()
            cmd = [sys.executable, "-m", "macfleet", "agent", "--role", "proposer", "--model",
                   "tiny:1", "--loopback", "--name", f"sec-{mode}", "--port", str(port)]
            cmd += ["--open"] if mode == "open" else ["--key", str(key_path)]
            log = open(tmp / f"{mode}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
            out[mode] = (f"tcp://127.0.0.1:{port}", None if mode == "open" else key)
        for endpoint, k in out.values():
            wait_ready(endpoint, k)
        yield out
    finally:
        for p, log in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            log.close()


def _states(nbytes: int, width: int = 512) -> np.ndarray:
    cols = min(width, max(1, nbytes // FLOAT16_BYTES))
    rows = max(1, nbytes // FLOAT16_BYTES // cols)
    return np.random.default_rng(nbytes).standard_normal((rows, cols)).astype(np.float16)


def _point(nbytes: int, ms: Sequence[float]) -> Point:
    return Point(nbytes, round(float(np.median(ms)), 3), round(percentile(ms, 95), 3),
                 round(min(ms), 3), len(ms))


def _hmac(frames, key: bytes = b"k" * 32) -> bytes:
    h = hmac.new(key, b"macfleet-msg-v1\0", hashlib.sha256)
    for f in frames:
        view = memoryview(f)
        h.update(struct.pack("<Q", view.nbytes))
        h.update(view)
    return h.digest()


def hmac_ms(states: np.ndarray, repeats: int) -> float:
    """Median ms a per-message HMAC would add to one hop (sign at one end, verify at the other)."""
    frames = codec.encode(HiddenStates("s", 0, list(range(states.shape[0])), states))
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        hmac.compare_digest(_hmac(frames), _hmac(frames))
        ms.append((time.perf_counter() - t) * 1e3)
    return round(float(np.median(ms)), 3)


def measure(endpoints: dict[str, tuple[str, bytes | None]], sizes: Sequence[int], repeats: int,
            progress: Callable[[str], None]) -> dict[str, list[Point]]:
    curves: dict[str, list[Point]] = {m: [] for m in MODES}
    clients = {m: Client(e, key=k) for m, (e, k) in endpoints.items()}
    try:
        for block, nbytes in enumerate(sizes):
            states = _states(nbytes)
            msg = HiddenStates("sec-bench", block, list(range(states.shape[0])), states)
            ms: dict[str, list[float]] = {m: [] for m in MODES}
            for i in range(repeats + 1):
                for m in MODES if i % 2 else MODES[::-1]:
                    t = time.perf_counter()
                    r = clients[m].request(msg, timeout=60)
                    dt = (time.perf_counter() - t) * 1e3
                    if not isinstance(r, HiddenStatesAck) or r.nbytes != states.nbytes:
                        raise RuntimeError(f"unexpected reply {r!r}")
                    if i:
                        ms[m].append(dt)
            for m in MODES:
                curves[m].append(_point(int(states.nbytes), ms[m]))
            progress(f"  {states.nbytes:>10d} B  open {curves['open'][-1].median_ms:8.3f} ms  "
                     f"closed {curves['closed'][-1].median_ms:8.3f} ms")
    finally:
        for c in clients.values():
            c.close()
    return curves


def encryption_cost(*, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS,
                    results: Path = Path("results"),
                    progress: Callable[[str], None] = lambda m: None) -> dict:
    with tempfile.TemporaryDirectory(prefix="macfleet-sec-") as tmp:
        with proposer_agents(Path(tmp)) as endpoints:
            curves = measure(endpoints, sizes, repeats, progress)
    rows = []
    for o, c in zip(curves["open"], curves["closed"]):
        h = hmac_ms(_states(o.nbytes), max(3, repeats // 2))
        rows.append({"nbytes": o.nbytes, "open_ms": o.median_ms, "closed_ms": c.median_ms,
                     "open_p95_ms": o.p95_ms, "closed_p95_ms": c.p95_ms,
                     "extra_ms": round(c.median_ms - o.median_ms, 3), "hmac_ms": h})
    block_ms, block_src = block_ms_from(results)
    flows = []
    for f in smollm2_flows():
        extra = interp_loglog(curves["closed"], f.nbytes) - interp_loglog(curves["open"], f.nbytes)
        flows.append({**asdict(f), "extra_ms": round(extra, 3),
                      "share_of_block": round(extra / block_ms, 4)})
    return {"what": "round trip HiddenStates -> ack to a proposer agent process on loopback, "
                    "open fleet vs closed fleet (CURVE), requests alternating",
            "repeats": repeats, "by_size": rows, "block_ms": block_ms, "block_ms_source": block_src,
            "smollm2_flows": flows,
            "notes": "extra_ms = closed - open median (noise on a shared 2-core box can make it "
                     "negative at small sizes); hmac_ms = what a per-message HMAC-SHA256 (sign + "
                     "verify, the pre-CURVE scheme, dropped) would add on top; share_of_block = extra_ms / block_ms, KV is paid once per "
                     "prompt, not per block"}
