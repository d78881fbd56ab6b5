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


def tiny_moe_shape(spec: str) -> ModelShape:
    """`tiny-moe:SEED[:VOCAB]`'s shape (macfleet/engine/tiny.py tiny_moe_args, float32; a test
    checks these figures against the built model)."""
    parts = spec.split(":")
    vocab = int(parts[2]) if len(parts) > 2 and parts[2] else 64
    layers, hidden, heads, kv, head_dim, experts, width = 4, 64, 8, 4, 16, 8, 64
    attn = hidden * head_dim * (2 * heads + 2 * kv) + 2 * head_dim + 2 * hidden
    router, expert = hidden * experts, experts * 3 * hidden * width
    params = layers * (attn + router + expert) + vocab * hidden + hidden
    return ModelShape(name=spec, param_bytes=4 * params, layers=layers, hidden=hidden,
                      heads=heads, kv_heads=kv, vocab=vocab, intermediate=128, experts=experts,
                      experts_per_tok=2, expert_bytes=4 * layers * expert,
                      expert_intermediate=width)


def _moe_fields(c: dict, size: int) -> dict:
    """An mlx-lm config's experts: counts, and their share of the weights' bytes by the
    parameter counts the config implies."""
    e = int(c.get("num_experts", c.get("num_local_experts", c.get("n_routed_experts", 0))) or 0)
    if not e:
        return {}
    h, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads", heads))
    hd = int(c.get("head_dim") or h // heads)
    width = int(c.get("moe_intermediate_size", c.get("intermediate_size", 0)))
    dense_only = len(c.get("mlp_only_layers", ())) + int(c.get("first_k_dense_replace", 0))
    moe = max(0, layers - dense_only)
    expert = moe * e * 3 * h * width
    dense = (layers * h * hd * (2 * heads + 2 * kv) + dense_only * 3 * h
             * int(c.get("intermediate_size", 0))
             + int(c.get("vocab_size", 32000)) * h * (1 if c.get("tie_word_embeddings") else 2))
    return dict(experts=e, experts_per_tok=int(c.get("num_experts_per_tok", 1)),
                expert_bytes=int(size * expert / (expert + dense)), expert_intermediate=width,
                moe_layers=moe)


def model_shape(spec: str | None) -> ModelShape:
    """The embedded SmolLM2's shape, the tiny MoE's, or an mlx-lm model directory's (its
    config.json and weights' size); ModelShapeError when none."""
    if spec is None or spec.split(":")[0] == "smollm2":
        return SMOLLM2
    if spec.split(":")[0] == "tiny-moe":
        return tiny_moe_shape(spec)
    p = Path(spec).expanduser()
    try:
        c = json.loads((p / "config.json").read_text())
        size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
        return ModelShape(name=p.name, param_bytes=size, layers=int(c["num_hidden_layers"]),
                          hidden=int(c["hidden_size"]), heads=int(c["num_attention_heads"]),
                          kv_heads=int(c.get("num_key_value_heads", c["num_attention_heads"])),
                          vocab=int(c.get("vocab_size", 32000)),
                          intermediate=int(c.get("intermediate_size", 0)),
                          **_moe_fields(c, size))
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
