"""`macfleet bench --fleet`: every agent measures itself through the tool plane.

For each discovered agent: a verify(L) sweep and the draft cost of the proposer kinds it
serves, and a link probe to every other agent -- run by the agent on its own hardware and
written to results/<host>/<preset>.json, where `macfleet plan` reads them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from bridge.card import AgentCard
from bridge.errors import INTERNAL, PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import PresetResult, RunPreset
from bridge.transport import Client

DEFAULT_PRESET_TIMEOUT_S = 600.0


def run_preset(card: AgentCard, key: bytes | None, preset: str, params: dict,
               timeout_s: float = DEFAULT_PRESET_TIMEOUT_S) -> dict:
    with Client(card.router_endpoint, key=key) as c:
        r = c.request(RunPreset(preset, params), timeout=timeout_s)
    if not isinstance(r, PresetResult):
        raise ProtocolError(INTERNAL, f"{card.name} answered {type(r).__name__}")
    return json.loads(r.result_json)


def plan_requests(card: AgentCard, others: list[AgentCard]) -> list[tuple[str, dict]]:
    """Pure: which presets to ask of one agent."""
    reqs: list[tuple[str, dict]] = [("verify_sweep", {"max_L": 16, "repeats": 3})]
    if "layerskip" in card.proposers:
        reqs.append(("draft_cost", {"proposer": "layerskip"}))
    if "ngram" in card.proposers or not card.proposers:
        reqs.append(("draft_cost", {"proposer": "ngram"}))
    for o in others:
        reqs.append(("link_probe", {"peer": o.router_endpoint}))
    return reqs


def profile_fleet(cards: list[AgentCard], key: bytes | None, out_dir: Path,
                  progress: Callable[[str], None] = lambda m: None) -> dict[str, list[str]]:
    """Returns host -> files written (errors are recorded in the host's errors.json)."""
    written: dict[str, list[str]] = {}
    for card in cards:
        host_dir = out_dir / _safe(card.name)
        host_dir.mkdir(parents=True, exist_ok=True)
        errors = []
        for preset, params in plan_requests(card, [c for c in cards if c is not card]):
            progress(f"{card.name}: {preset} {params}")
            try:
                res = run_preset(card, key, preset, params)
            except (ProtocolError, TransportTimeout, PeerUnavailable) as e:
                errors.append({"preset": preset, "params": params, "error": str(e)})
                continue
            name = preset + ("" if preset == "verify_sweep" else "-" + _safe(
                str(params.get("proposer") or params.get("peer"))))
            path = host_dir / f"{name}.json"
            path.write_text(json.dumps(res, indent=2) + "\n")
            written.setdefault(card.name, []).append(str(path))
        if errors:
            (host_dir / "errors.json").write_text(json.dumps(errors, indent=2) + "\n")
    return written


def _safe(s: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in s)[:80]
