"""The planner's input: a described fleet (hosts, links, model shape, measured profiles).

Not to be confused with macfleet/fleet/snapshot.py, the *observed* fleet the dashboard shows:
this is what `macfleet plan` plans for (built by topology/inputs.py or from `--simulate`).

Pure data. `snapshot_from_dict` parses the JSON of `macfleet plan --simulate` (and what the
CLI builds from a live fleet); it raises `SnapshotError` naming the bad field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GB = 1024**3

# Stated defaults, used when nothing was measured (see `DEFAULT_PROFILE_NOTE`).
# verify(L) of SmolLM2-135M dense on one Linux CPU core with OpenBLAS (order of magnitude).
DEFAULT_VERIFY_MS: tuple[tuple[int, float], ...] = (
    (1, 24.0), (2, 26.0), (4, 29.0), (8, 36.0), (16, 52.0), (32, 88.0))
DEFAULT_PROPOSERS: tuple[tuple[str, float, float, float], ...] = (
    # kind, ms per drafted token, acceptance per token, memory (fraction of verifier params)
    ("ngram", 0.05, 0.35, 0.0),
    ("layerskip", 6.0, 0.55, 0.25),
    ("draft", 4.0, 0.65, 0.15),
)
DEFAULT_PROFILE_NOTE = ("default profile (not measured): verify(L) of SmolLM2-135M on a Linux CPU "
                        "core; ngram α=0.35 c=0.05 ms, layerskip α=0.55 c=6 ms, draft α=0.65 c=4 ms")
DEFAULT_LINK = (1.0, 100.0)  # RTT ms, MB/s: gigabit Ethernet on a desk
DEFAULT_MEM_OVERHEAD = 1.25  # activations, KV cache and runtime over the raw weights


class SnapshotError(ValueError):
    """A fleet description that cannot be planned; the message names the field."""


@dataclass(frozen=True)
class Host:
    name: str
    chip: str = ""
    mem_free: int = 0  # bytes
    roles: tuple[str, ...] = ()  # roles the agent offers; empty = any


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    rtt_ms: float
    bandwidth_mb_s: float  # MB/s (1e6 bytes per second)

    def transfer_ms(self, nbytes: float) -> float:
        """One message: half a round trip of latency plus serialization at the link rate."""
        return self.rtt_ms / 2 + nbytes / (self.bandwidth_mb_s * 1e3)


LOOPBACK = Link("", "", 0.0, 1e9)
MOE_FIELDS = ("experts", "experts_per_tok", "expert_bytes", "expert_intermediate", "moe_layers")


@dataclass(frozen=True)
class ModelShape:
    name: str
    param_bytes: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int = 49152
    intermediate: int = 0
    # a mixture of experts (topology/moe.py); experts = 0: a dense model
    experts: int = 0
    experts_per_tok: int = 0
    expert_bytes: int = 0  # all experts' weights (of param_bytes); the rest is replicated
    expert_intermediate: int = 0  # one expert's MLP width
    moe_layers: int = 0  # 0: every layer is sparse


SMOLLM2 = ModelShape("smollm2", param_bytes=538_000_000, layers=30, hidden=576, heads=9,
                     kv_heads=3, vocab=49152, intermediate=1536)


@dataclass(frozen=True)
class ProposerProfile:
    kind: str
    ms_per_token: float  # c: cost of drafting one token
    acceptance: float  # α: probability a drafted token is accepted (per position)
    mem_fraction: float = 0.0  # memory as a fraction of the verifier's weights


@dataclass(frozen=True)
class Profile:
    verify_ms: tuple[tuple[int, float], ...] = DEFAULT_VERIFY_MS  # (L, ms), measured on ref_chip
    proposers: tuple[ProposerProfile, ...] = tuple(ProposerProfile(*p) for p in DEFAULT_PROPOSERS)
    ref_chip: str = ""
    source: str = DEFAULT_PROFILE_NOTE

    def proposer(self, kind: str) -> ProposerProfile:
        for p in self.proposers:
            if p.kind == kind:
                return p
        raise SnapshotError(f"no profile for proposer kind '{kind}'; have "
                            f"{[p.kind for p in self.proposers]}")

    def verify(self, L: int) -> float:
        """verify(L) in ms, linear between measured points, extrapolated past the last two."""
        pts = sorted(self.verify_ms)
        if L <= pts[0][0]:
            return pts[0][1]
        for (l0, m0), (l1, m1) in zip(pts, pts[1:]):
            if L <= l1:
                return m0 + (m1 - m0) * (L - l0) / (l1 - l0)
        (l0, m0), (l1, m1) = pts[-2], pts[-1]
        return m1 + (m1 - m0) * (L - l1) / (l1 - l0)


@dataclass(frozen=True)
class Fleet:
    hosts: tuple[Host, ...]
    model: ModelShape = SMOLLM2
    profile: Profile = field(default_factory=Profile)
    links: tuple[Link, ...] = ()
    default_link: Link = Link("*", "*", *DEFAULT_LINK)

    def link(self, a: str, b: str) -> Link:
        if a == b:
            return LOOPBACK
        for ln in self.links:
            if {ln.a, ln.b} == {a, b}:
                return ln
        return self.default_link

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)


# --- parsing -----------------------------------------------------------------------------------


def _num(d: Mapping[str, Any], key: str, where: str, default: Any = None) -> float:
    v = d.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise SnapshotError(f"{where}.{key}: expected a non-negative number, got {v!r}")
    return v


def _mem(d: Mapping[str, Any], where: str) -> int:
    if "mem_free_gb" in d:
        return int(_num(d, "mem_free_gb", where) * GB)
    return int(_num(d, "mem_free", where, 0))


def snapshot_from_dict(d: Mapping[str, Any], profile: Profile | None = None) -> Fleet:
    """Parse a fleet description (see macfleet/topology/examples/desk-8-macs.json)."""
    if not isinstance(d, Mapping) or not isinstance(d.get("hosts"), list) or not d["hosts"]:
        raise SnapshotError("hosts: expected a non-empty list")
    hosts = []
    for i, h in enumerate(d["hosts"]):
        where = f"hosts[{i}]"
        if not isinstance(h, Mapping) or not isinstance(h.get("name"), str) or not h["name"]:
            raise SnapshotError(f"{where}.name: expected a string")
        hosts.append(Host(h["name"], str(h.get("chip", "")), _mem(h, where),
                          tuple(h.get("roles", ()))))
    if len({h.name for h in hosts}) != len(hosts):
        raise SnapshotError("hosts: names must be unique")
    names = {h.name for h in hosts}
    links = []
    for i, ln in enumerate(d.get("links", [])):
        where = f"links[{i}]"
        if ln.get("a") not in names or ln.get("b") not in names:
            raise SnapshotError(f"{where}: a and b must name hosts")
        links.append(Link(ln["a"], ln["b"], _num(ln, "rtt_ms", where),
                          _num(ln, "bandwidth_mb_s", where)))
    dl = d.get("default_link", {})
    default = Link("*", "*", _num(dl, "rtt_ms", "default_link", DEFAULT_LINK[0]),
                   _num(dl, "bandwidth_mb_s", "default_link", DEFAULT_LINK[1]))
    model = SMOLLM2
    if "model" in d:
        m = d["model"]
        try:
            model = ModelShape(name=str(m.get("name", "model")),
                               param_bytes=int(_num(m, "param_bytes", "model")),
                               layers=int(m["layers"]), hidden=int(m["hidden"]),
                               heads=int(m["heads"]), kv_heads=int(m.get("kv_heads", m["heads"])),
                               vocab=int(m.get("vocab", 32000)),
                               intermediate=int(m.get("intermediate", 0)),
                               **{f: int(m[f]) for f in MOE_FIELDS if f in m})
        except (KeyError, TypeError, ValueError) as e:
            raise SnapshotError(f"model: {e}") from None
    if profile is None:
        profile = profile_from_dict(d["profile"]) if "profile" in d else Profile()
    return Fleet(tuple(hosts), model, profile, tuple(links), default)


def profile_from_dict(p: Mapping[str, Any]) -> Profile:
    base = Profile()
    try:
        vm = tuple((int(L), float(ms)) for L, ms in p.get("verify_ms", base.verify_ms))
        props = tuple(ProposerProfile(str(q["kind"]), float(q["ms_per_token"]),
                                      float(q["acceptance"]), float(q.get("mem_fraction", 0.0)))
                      for q in p["proposers"]) if "proposers" in p else base.proposers
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"profile: {e}") from None
    if len(vm) < 2 or any(not 0 <= q.acceptance < 1 for q in props):
        raise SnapshotError("profile: need >= 2 verify points and acceptance in [0, 1)")
    return Profile(vm, props, str(p.get("ref_chip", "")), str(p.get("source", "given")))
