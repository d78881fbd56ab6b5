"""What `macfleet plan` plans with, read from where it lives: measured profiles in results/, a
model's shape from its config.json, and a live fleet's hosts and links from the statuses of its
discovered agents. The one module of topology that reads files; the planner stays pure.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from macfleet.topology.fleet_spec import SMOLLM2, Fleet, Host, Link, ModelShape, Profile


class ModelShapeError(ValueError):
    """A model spec whose shape cannot be read (the message says what to use instead)."""


def measured_profile(results: Path) -> Profile:
    """Profile from results/verify_l_sweep.json and results/local_spec.json, else defaults."""
    prof, used = Profile(), []
    sweep = results / "verify_l_sweep.json"
    per_host = sorted(results.glob("*/verify_sweep.json"))  # measured by agents (tool plane)
    if per_host:
        sweep = per_host[0]
    try:
        d = json.loads(sweep.read_text())
        curve = min(d["curves"], key=lambda c: c["context"])
        pts = tuple((int(p["L"]), float(p["ms"])) for p in curve["points"])
        if len(pts) >= 2:
            prof = replace(prof, verify_ms=pts)
            used.append(f"verify(L) from {sweep} (context {curve['context']})")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    spec = results / "local_spec.json"
    try:
        d = json.loads(spec.read_text())
        acc: dict[str, list[float]] = {}
        for pr in d["prompts"].values():
            for m, r in pr["methods"].items():
                if m.startswith("macfleet[") and "acceptance" in r:
                    kind = m[len("macfleet["):].split(":")[0].split(",")[0].rstrip("]")
                    acc.setdefault(kind, []).append(float(r["acceptance"]))
        if acc:
            props = tuple(replace(p, acceptance=min(0.99, sum(acc[p.kind]) / len(acc[p.kind])))
                          if p.kind in acc else p for p in prof.proposers)
            prof = replace(prof, proposers=props)
            used.append(f"acceptance of {sorted(acc)} from {spec}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    costs = {}
    for f in sorted(results.glob("*/draft_cost-*.json")):
        try:
            d = json.loads(f.read_text())
            costs[d["proposer"].split(":")[0]] = float(d["ms_per_token"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if costs:
        props = tuple(replace(p, ms_per_token=costs[p.kind]) if p.kind in costs else p
                      for p in prof.proposers)
        prof = replace(prof, proposers=props)
        used.append(f"draft cost of {sorted(costs)} from {results}/<host>/draft_cost-*.json")
    if used:
        prof = replace(prof, source="; ".join(used) + "; other numbers: " + prof.source)
    return prof


def model_shape(spec: str | None) -> ModelShape:
    """The embedded SmolLM2's shape, or an mlx-lm model directory's (its config.json and
    weights' size); ModelShapeError when neither."""
    if spec is None or spec.split(":")[0] == "smollm2":
        return SMOLLM2
    p = Path(spec).expanduser()
    try:
        c = json.loads((p / "config.json").read_text())
        size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
        return ModelShape(p.name, size, int(c["num_hidden_layers"]), int(c["hidden_size"]),
                          int(c["num_attention_heads"]),
                          int(c.get("num_key_value_heads", c["num_attention_heads"])),
                          int(c.get("vocab_size", 32000)), int(c.get("intermediate_size", 0)))
    except (OSError, ValueError, KeyError) as e:
        raise ModelShapeError(f"cannot read the shape of model '{spec}' ({e}); use smollm2 or "
                              "an mlx-lm model directory") from None


def fleet_from_statuses(live: Sequence, profile: Profile, shape: ModelShape) -> Fleet:
    """Hosts from live agents' statuses (fleet/client.py `probe`); a link's RTT ~ the larger of
    the two client RTTs."""
    hosts = tuple(Host(s.card.name, s.card.chip, s.card.mem_free, tuple(s.card.roles))
                  for s in live)
    links = tuple(Link(a.card.name, b.card.name,
                       max(a.rtt_p50_ms or 0.0, b.rtt_p50_ms or 0.0), 100.0)
                  for i, a in enumerate(live) for b in live[i + 1:])
    return Fleet(hosts, shape, profile, links)
