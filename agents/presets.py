"""The tool plane: allowlisted benchmark presets an agent runs on its own hardware.

Profiles must be measured where they apply, so the CLI asks each agent to measure itself. A
request names a preset and typed parameters that `validate` (pure) checks against the
allowlist: no shell, no path, no code, only a function chosen by name from `PRESETS`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bridge.errors import BAD_REQUEST, ProtocolError


@dataclass(frozen=True)
class Param:
    kind: type  # int | float | str
    default: float | int | str
    lo: float | None = None
    hi: float | None = None
    pattern: str | None = None  # for str


@dataclass(frozen=True)
class Preset:
    name: str
    doc: str
    params: dict[str, Param]
    run: Callable  # (agent, params) -> dict (JSON-able)


_ENDPOINT = r"tcp://[0-9a-zA-Z.\-:\[\]]{1,64}:[0-9]{1,5}"
_PROPOSER = r"(ngram(:[1-8])?|layerskip(:[0-9]{1,3})?)"


def validate(preset: str, params: dict) -> tuple[Preset, dict]:
    """Pure: the preset and its complete, checked parameters; ProtocolError(bad_request)."""
    p = PRESETS.get(preset)
    if p is None:
        raise ProtocolError(BAD_REQUEST, f"unknown preset '{preset}'; allowed: {sorted(PRESETS)}")
    extra = set(params) - set(p.params)
    if extra:
        raise ProtocolError(BAD_REQUEST, f"preset {preset} takes no {sorted(extra)}")
    out = {}
    for name, spec in p.params.items():
        v = params.get(name, spec.default)
        if spec.kind is int and isinstance(v, float) and v.is_integer():
            v = int(v)
        if spec.kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, spec.kind) or isinstance(v, bool):
            raise ProtocolError(BAD_REQUEST, f"{preset}.{name} must be {spec.kind.__name__}")
        if spec.lo is not None and not spec.lo <= v <= spec.hi:
            raise ProtocolError(BAD_REQUEST, f"{preset}.{name} must be in {spec.lo}..{spec.hi}")
        if spec.pattern is not None and not re.fullmatch(spec.pattern, v):
            raise ProtocolError(BAD_REQUEST, f"{preset}.{name}: '{v}' is not allowed")
        out[name] = v
    return p, out


def peers_named(preset: Preset, params: dict) -> list[str]:
    """Endpoints a checked preset would connect to (each must pass bridge.peers first)."""
    return [params["peer"]] if preset.name == "link_probe" else []


def _verify_sweep(agent, prm: dict) -> dict:
    from macfleet.engine.verify_costs import verify_sweep

    lengths = tuple(range(1, prm["max_L"] + 1))
    return verify_sweep(agent.lm, lengths=lengths, contexts=(prm["context"],),
                        repeats=prm["repeats"])


def _draft_cost(agent, prm: dict) -> dict:
    """ms per drafted token of a proposer kind on this host (greedy chain)."""
    from macfleet.engine.proposers import make_proposer
    from macfleet.engine.sampling import GREEDY

    spec = prm["proposer"]
    if spec == "layerskip":  # a depth that fits any model: two thirds of its layers
        spec = f"layerskip:{max(1, agent.lm.num_layers * 2 // 3)}"
    prop = make_proposer(spec, agent.lm)
    prop.start(GREEDY)
    ctx = [(i * 7919) % agent.lm.vocab_size for i in range(64)]
    prop.propose(ctx, 2)  # warm-up (and prefill of the context)
    xs = []
    for r in range(prm["repeats"]):
        t = time.perf_counter()
        d = prop.propose(ctx + [r + 1], prm["tokens"])
        xs.append((time.perf_counter() - t) * 1e3 / max(len(d), 1))
    prop.close()
    return {"model": agent.lm.spec, "proposer": spec,
            "ms_per_token": float(np.median(xs)), "tokens": prm["tokens"]}


def _link_probe(agent, prm: dict) -> dict:
    """RTT and throughput from this agent to a peer agent: hidden-state-sized payloads (F3)."""
    from bridge.messages import HiddenStates, Ping
    from bridge.transport import Client

    out = {"peer": prm["peer"], "points": []}
    with Client(prm["peer"], key=agent.cfg.key, connect_timeout_s=2.0) as c:
        rtts = []
        for i in range(prm["repeats"]):
            t = time.perf_counter()
            c.request(Ping(i, 0), timeout=2.0)
            rtts.append((time.perf_counter() - t) * 1e3)
        out["rtt_ms_p50"] = float(np.median(rtts))
        for nbytes in (1024, 64 * 1024, prm["bytes"]):
            states = np.zeros((max(1, nbytes // 2 // 1024), 1024), dtype=np.float16)
            xs = []
            for _ in range(prm["repeats"]):
                t = time.perf_counter()
                c.request(HiddenStates("probe", 0, list(range(len(states))), states), timeout=10.0)
                xs.append((time.perf_counter() - t) * 1e3)
            ms = float(np.median(xs))
            out["points"].append({"bytes": int(states.nbytes), "ms": ms})
        big = out["points"][-1]
        out["mb_per_s"] = big["bytes"] / 1e6 / max((big["ms"] - out["rtt_ms_p50"]) / 1e3, 1e-6)
    return out


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("verify_sweep", "verify(L) for L=1..max_L at one context length",
           {"max_L": Param(int, 16, 1, 32), "repeats": Param(int, 3, 1, 10),
            "context": Param(int, 64, 1, 2048)}, _verify_sweep),
    Preset("draft_cost", "ms per drafted token of a proposer kind",
           {"proposer": Param(str, "ngram", pattern=_PROPOSER), "tokens": Param(int, 4, 1, 16),
            "repeats": Param(int, 3, 1, 10)}, _draft_cost),
    Preset("link_probe", "RTT and throughput to a peer agent (F3-sized payloads)",
           {"peer": Param(str, "", pattern=_ENDPOINT), "bytes": Param(int, 1 << 20, 1024, 16 << 20),
            "repeats": Param(int, 5, 1, 20)}, _link_probe),
)}
