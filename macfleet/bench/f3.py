"""`macfleet bench f3`: the wire cost of flow F3 (hidden states, verifier -> proposer).

A proposer agent acknowledges `HiddenStates` at once on its loop thread (no drafter consumes
them yet), so the round trip to the `HiddenStatesAck` is serialize + sign + wire + verify +
decode, nothing else. This bench sends float16 payloads of growing size to a real proposer
agent over each link it can build here:

  loopback       a local 2-agent fleet, this process as the verifier side
  netns-veth     two network namespaces on a Linux bridge (root + iproute2), no rate limit
  netns-wifi     the same link with the test bed's Wi-Fi-like `tbf` rate on both ends

and puts next to them what a hidden-state drafter would really need per block
(`f3_payload_bytes`): hidden size x layers used (EAGLE 1, EAGLE-3 3) x accepted tokens x 2 bytes.
The ms at those sizes is interpolated (log-log) from the measured curve.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bridge.card import ROLE_PROPOSER
from bridge.errors import INTERNAL, PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import HiddenStates, HiddenStatesAck, Ping, Pong
from bridge.transport import Client
from macfleet.fleet import local
from macfleet.fleet.keys import keygen, load_key

log = logging.getLogger(__name__)

KIB = 1024
DEFAULT_SIZES = tuple(KIB * 4**i for i in range(8))  # 1 KiB .. 16 MiB
DEFAULT_REPEATS = 10
DEFAULT_WIDTH = 512  # float16 columns of the probe array (rows = bytes / 2 / width)
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_READY_TIMEOUT_S = 90.0
PROBE_PORT = 47311
FLOAT16_BYTES = 2

# (name, hidden size) of verifiers a hidden-state drafter would serve.
VERIFIERS: tuple[tuple[str, int], ...] = (("SmolLM2-135M", 576), ("8B (Llama-3-8B)", 4096),
                                          ("70B (Llama-3-70B)", 8192))
DRAFTERS: tuple[tuple[str, int], ...] = (("EAGLE", 1), ("EAGLE-3", 3))  # layers of features
ACCEPTED_TOKENS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Point:
    nbytes: int
    median_ms: float
    p95_ms: float
    min_ms: float
    repeats: int


@dataclass(frozen=True)
class RealPayload:
    verifier: str
    hidden: int
    drafter: str
    layers: int
    tokens: int
    nbytes: int


def f3_payload_bytes(hidden: int, layers: int, tokens: int,
                     dtype_bytes: int = FLOAT16_BYTES) -> int:
    """Bytes of hidden states per block: accepted tokens x layers of features x hidden."""
    if min(hidden, layers, tokens, dtype_bytes) < 0:
        raise ValueError("sizes must be non-negative")
    return hidden * layers * tokens * dtype_bytes


def real_payloads(verifiers=VERIFIERS, drafters=DRAFTERS,
                  tokens: Sequence[int] = ACCEPTED_TOKENS) -> list[RealPayload]:
    return [RealPayload(verifier=v, hidden=h, drafter=d, layers=n, tokens=t,
                        nbytes=f3_payload_bytes(h, n, t))
            for v, h in verifiers for d, n in drafters for t in tokens]


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))])


def interp_loglog(points: Sequence[Point], nbytes: float) -> float:
    """Median ms at nbytes, linear in log-log between measured sizes (clamped at the ends)."""
    pts = sorted(points, key=lambda p: p.nbytes)
    if nbytes <= pts[0].nbytes:
        return pts[0].median_ms
    for a, b in zip(pts, pts[1:]):
        if nbytes <= b.nbytes:
            t = (math.log(nbytes) - math.log(a.nbytes)) / (math.log(b.nbytes) - math.log(a.nbytes))
            return math.exp(math.log(a.median_ms) + t * (math.log(b.median_ms) -
                                                         math.log(a.median_ms)))
    return pts[-1].median_ms


# --- the measurement (runs in this process, or inside a namespace via `python -m`) -----------


def wait_ready(endpoint: str, key: bytes | None, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
    """Ping until the agent answers (it may still be importing MLX)."""
    deadline = time.monotonic() + timeout_s
    seq = 0
    while time.monotonic() < deadline:
        try:
            with Client(endpoint, key=key, connect_timeout_s=2.0) as c:
                if isinstance(c.request(Ping(seq, time.perf_counter_ns()), timeout=2.0), Pong):
                    return
        except (PeerUnavailable, TransportTimeout):
            seq += 1
            time.sleep(0.5)
    raise TimeoutError(f"no agent answering at {endpoint} within {timeout_s:.0f}s")


def probe(endpoint: str, key: bytes | None, sizes: Sequence[int] = DEFAULT_SIZES,
          repeats: int = DEFAULT_REPEATS, width: int = DEFAULT_WIDTH,
          progress: Callable[[str], None] = lambda m: None) -> list[Point]:
    """Round-trip ms of HiddenStates -> HiddenStatesAck per payload size (one warm-up each)."""
    out = []
    with Client(endpoint, key=key) as c:
        for block, nbytes in enumerate(sizes):
            cols = min(width, max(1, nbytes // FLOAT16_BYTES))
            rows = max(1, nbytes // FLOAT16_BYTES // cols)
            states = np.random.default_rng(block).standard_normal((rows, cols)).astype(np.float16)
            msg = HiddenStates("f3-bench", block, list(range(rows)), states)
            ms = []
            for i in range(repeats + 1):
                t = time.perf_counter()
                r = c.request(msg, timeout=DEFAULT_REQUEST_TIMEOUT_S)
                dt = (time.perf_counter() - t) * 1e3
                if not isinstance(r, HiddenStatesAck) or r.nbytes != states.nbytes:
                    raise ProtocolError(INTERNAL, f"unexpected reply {r!r}")
                if i:  # the first one warms the connection and buffers
                    ms.append(dt)
            p = Point(int(states.nbytes), round(float(np.median(ms)), 3),
                      round(percentile(ms, 95), 3), round(min(ms), 3), repeats)
            progress(f"  {p.nbytes:>10d} B  median {p.median_ms:9.3f} ms  p95 {p.p95_ms:9.3f} ms")
            out.append(p)
    return out


# --- links ------------------------------------------------------------------------------------


def loopback_link(sizes, repeats, progress) -> list[Point]:
    with tempfile.TemporaryDirectory(prefix="macfleet-f3-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        run_dir = Path(tmp) / "run"
        cards = local.up(2, model="tiny:1", key=key, key_path=key_path, run_dir=run_dir)
        try:
            p = next(c for c in cards if ROLE_PROPOSER in c.roles)
            return probe(p.router_endpoint, key, sizes, repeats, progress=progress)
        finally:
            local.down(run_dir)


def load_testbed():
    """tests/testbed/netns.py of a source checkout (the test bed is not shipped in the wheel)."""
    path = Path(__file__).resolve().parents[2] / "tests" / "testbed" / "netns.py"
    if not path.exists():
        return None, f"{path} not found (the namespace test bed lives in a source checkout)"
    spec = importlib.util.spec_from_file_location("macfleet_testbed_netns", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod, mod.available()


def netns_links(sizes, repeats, progress) -> tuple[dict[str, list[Point]], dict[str, str]]:
    """A proposer agent in namespace h0, this module's probe in h1; veth, then veth + tbf."""
    netns, why = load_testbed()
    if why:
        return {}, {"netns-veth": why, "netns-wifi": why}
    out: dict[str, list[Point]] = {}
    with tempfile.TemporaryDirectory(prefix="macfleet-f3-") as tmp, netns.Testbed(2) as tb:
        key_path = Path(tmp) / "fleet.key"
        keygen(key_path)
        srv, cli = tb.hosts
        with open(Path(tmp) / "proposer.log", "wb") as logf:
            tb.popen(srv, [sys.executable, "-m", "macfleet", "agent", "--role", "proposer",
                           "--model", "tiny:1", "--name", "f3-proposer", "--bind", srv.ip,
                           "--port", str(PROBE_PORT), "--key", str(key_path)],
                     stdout=logf, stderr=subprocess.STDOUT)
        endpoint = f"tcp://{srv.ip}:{PROBE_PORT}"
        for name in ("netns-veth", "netns-wifi"):
            if name == "netns-wifi":
                for h in tb.hosts:
                    r = tb.run(h, ["tc", "qdisc", "add", "dev", h.veth_ns, "root", "tbf", "rate",
                                   netns.WIFI_RATE, "burst", netns.WIFI_BURST, "latency",
                                   netns.WIFI_LATENCY])
                    if r.returncode:
                        raise RuntimeError(f"tc failed: {r.stderr.strip()}")
            progress(f"{name} ({endpoint}):")
            r = tb.run(cli, [sys.executable, "-m", "macfleet.bench.f3", "--endpoint", endpoint,
                             "--key", str(key_path), "--repeats", str(repeats),
                             "--sizes", ",".join(map(str, sizes))], timeout=900)
            if r.returncode:
                raise RuntimeError(f"probe in {cli.name} failed: {r.stderr[-2000:]}")
            out[name] = [Point(**d) for d in json.loads(r.stdout.strip().splitlines()[-1])]
            for p in out[name]:
                progress(f"  {p.nbytes:>10d} B  median {p.median_ms:9.3f} ms  p95 {p.p95_ms:9.3f} ms")
    return out, {}


# --- the bench --------------------------------------------------------------------------------


def bench_f3(*, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS,
             netns: bool = True, progress: Callable[[str], None] = lambda m: None) -> dict:
    progress("loopback:")
    links = {"loopback": loopback_link(sizes, repeats, progress)}
    skipped: dict[str, str] = {}
    if netns:
        got, skipped = netns_links(sizes, repeats, progress)
        links.update(got)
    else:
        skipped = {"netns-veth": "--no-netns", "netns-wifi": "--no-netns"}
    reals = real_payloads()
    at_real = [dict(asdict(r), ms={ln: round(interp_loglog(pts, r.nbytes), 3)
                                   for ln, pts in links.items()}) for r in reals]
    return {
        "what": "round trip HiddenStates -> HiddenStatesAck to a proposer agent (float16)",
        "repeats": repeats,
        "links": {ln: [asdict(p) for p in pts] for ln, pts in links.items()},
        "link_notes": {
            "loopback": "127.0.0.1 TCP, agents pinned one core each, this process unpinned",
            "netns-veth": "two network namespaces, veth pair via a Linux bridge, no rate limit",
            "netns-wifi": "same, with tbf rate 100mbit burst 32kbit latency 50ms on both ends "
                          "(tests/testbed/netns.py WIFI_*)",
        },
        "skipped_links": skipped,
        "real_payloads": at_real,
        "notes": "real payloads: hidden x layers (EAGLE 1, EAGLE-3 3) x accepted tokens x 2 "
                 "bytes; ms interpolated log-log from the measured medians. Prefill F3 (the "
                 "prompt's hidden states) is prompt_len times larger and is paid once.",
    }


def plot(res: dict, path: Path) -> Path | None:
    """ms per block vs payload bytes, log-log, one line per link; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    link_colors = ("tab:blue", "tab:purple", "black")
    for i, (ln, pts) in enumerate(res["links"].items()):
        x = [p["nbytes"] for p in pts]
        c = link_colors[i % len(link_colors)]
        ax.plot(x, [p["median_ms"] for p in pts], marker="o", color=c, label=f"{ln} (median)")
        ax.fill_between(x, [p["median_ms"] for p in pts], [p["p95_ms"] for p in pts], color=c,
                        alpha=0.15)
    colors = {"SmolLM2-135M": "tab:green", "8B (Llama-3-8B)": "tab:orange",
              "70B (Llama-3-70B)": "tab:red"}
    seen = set()
    for r in res["real_payloads"]:
        if r["tokens"] not in (1, 5):
            continue
        lab = f"{r['verifier']} {r['drafter']}, 1-5 tok"
        c = colors.get(r["verifier"], "grey")
        ax.axvline(r["nbytes"], color=c, ls="--" if r["drafter"] == "EAGLE" else ":",
                   lw=1, label=None if lab in seen else lab)
        seen.add(lab)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("F3 payload per block (bytes, float16)")
    ax.set_ylabel("round trip to ack (ms per block)")
    ax.set_title("F3 hidden-state transfer cost (dashed EAGLE, dotted EAGLE-3; 1 and 5 tokens)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _main(argv: Sequence[str] | None = None) -> int:
    """In-namespace probe: prints the points as one JSON line."""
    ap = argparse.ArgumentParser(prog="python -m macfleet.bench.f3")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    a = ap.parse_args(argv)
    key = load_key(a.key)
    wait_ready(a.endpoint, key)
    pts = probe(a.endpoint, key, [int(s) for s in a.sizes.split(",")], a.repeats)
    print(json.dumps([asdict(p) for p in pts]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
