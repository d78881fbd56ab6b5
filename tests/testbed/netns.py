"""A multi-host test bed on one Linux machine: N network namespaces on one bridge.

Each host is a namespace with its own veth into a private Linux bridge, an address in a private
test subnet (10.199.0.0/24 by default: only inside namespaces created here, so several test beds
can coexist; each bridge is its own L2 domain), a 224.0.0.0/4 route so Zeroconf multicast leaves
through the veth, and optionally a `tbf` rate limit (a Wi-Fi-like link). Commands and agents
run inside with `ip netns exec`. `close()` removes every namespace, veth and the bridge, also
after a failure (use it as a context manager).

Needs root and iproute2; `available()` says why not, for a pytest skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

DEFAULT_SUBNET = "10.199.0"
WIFI_RATE = "100mbit"  # a good 5 GHz link in practice; tbf also adds queueing like Wi-Fi
WIFI_BURST = "32kbit"
WIFI_LATENCY = "50ms"


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) not installed"
    probe = f"mfprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    ip: str
    veth_root: str  # the bridge side (cut the link here)
    veth_ns: str  # inside the namespace


class Testbed:
    def __init__(self, n: int, *, subnet: str = DEFAULT_SUBNET, rate: str | None = None,
                 tag: str | None = None) -> None:
        if not 1 <= n <= 50:
            raise ValueError("1..50 hosts")
        self.tag = tag or f"{os.getpid() % 100000}"
        self.subnet = subnet
        self.bridge = f"mfbr{self.tag}"[:15]
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge", "mcast_snooping", "0")
            _ip("ip", "link", "set", self.bridge, "up")
            for i in range(n):
                self.hosts.append(self._add_host(i, subnet, rate))
        except BaseException:
            self.close()
            raise

    def _add_host(self, i: int, subnet: str, rate: str | None) -> Host:
        h = Host(f"mf{self.tag}h{i}", f"{subnet}.{i + 1}", f"mf{self.tag}r{i}"[:15],
                 f"mf{self.tag}n{i}"[:15])
        _ip("ip", "netns", "add", h.name)
        self.hosts.append(h)  # from here on close() removes it
        _ip("ip", "link", "add", h.veth_root, "type", "veth", "peer", "name", h.veth_ns)
        _ip("ip", "link", "set", h.veth_ns, "netns", h.name)
        _ip("ip", "link", "set", h.veth_root, "master", self.bridge, "up")
        _ip("ip", "link", "set", "lo", "up", ns=h.name)
        _ip("ip", "addr", "add", f"{h.ip}/24", "dev", h.veth_ns, ns=h.name)
        _ip("ip", "link", "set", h.veth_ns, "up", "multicast", "on", ns=h.name)
        _ip("ip", "route", "add", "224.0.0.0/4", "dev", h.veth_ns, ns=h.name)
        if rate:
            _ip("tc", "qdisc", "add", "dev", h.veth_ns, "root", "tbf", "rate", rate, "burst",
                WIFI_BURST, "latency", WIFI_LATENCY, ns=h.name)
        self.hosts.pop()
        return h

    def join_root(self, host: int = 254) -> str:
        """Give the bridge an address (<subnet>.host) in the root namespace, so processes here
        reach the hosts (and browse their Zeroconf) across it; returns the address."""
        ip = f"{self.subnet}.{host}"
        _ip("ip", "addr", "add", f"{ip}/24", "dev", self.bridge)
        return ip

    def popen(self, host: Host, cmd: list[str], **kw) -> subprocess.Popen:
        """Start a process inside the host's namespace (killed by close())."""
        p = subprocess.Popen(["ip", "netns", "exec", host.name, *cmd], **kw)
        self._procs.append(p)
        return p

    def run(self, host: Host, cmd: list[str], timeout: float = 60, **kw
            ) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.name, *cmd], capture_output=True,
                              text=True, timeout=timeout, **kw)

    def set_link(self, host: Host, up: bool) -> None:
        """Cut (or restore) a host's link at the bridge: its packets go nowhere, like a
        Wi-Fi drop; the namespace keeps its address, so sockets do not notice at once."""
        _ip("ip", "link", "set", host.veth_root, "up" if up else "down")

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._procs.clear()
        for h in self.hosts:
            _ip("ip", "link", "del", h.veth_root, check=False)  # removes the peer too
            _ip("ip", "netns", "del", h.name, check=False)
        self.hosts.clear()
        _ip("ip", "link", "del", self.bridge, check=False)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
