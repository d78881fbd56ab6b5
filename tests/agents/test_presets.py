"""The tool plane: allowlisted presets with typed, capped parameters, run by the agent itself."""

from __future__ import annotations

import json

import pytest

from agents.daemon import Agent, AgentConfig
from agents.presets import validate
from bridge.errors import ProtocolError
from bridge.messages import PresetResult, RunPreset
from bridge.transport import Client
from macfleet.fleet.profile import plan_requests, profile_fleet

KEY = b"t" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed


@pytest.mark.parametrize("preset,params,why", [
    ("rm -rf /", {}, "unknown preset"),
    ("verify_sweep", {"max_L": 1000}, "max_L must be in"),
    ("verify_sweep", {"max_L": "16"}, "must be int"),
    ("verify_sweep", {"shell": "ls"}, "takes no"),
    ("draft_cost", {"proposer": "draft:/etc/passwd"}, "not allowed"),
    ("link_probe", {"peer": "tcp://1.2.3.4:5; ls"}, "not allowed"),
])
def test_validate_refuses_what_is_not_allowlisted(preset, params, why):
    with pytest.raises(ProtocolError) as e:
        validate(preset, params)
    assert e.value.code == "bad_request" and why in str(e.value)


def test_validate_fills_defaults_and_accepts_integral_floats():
    p, prm = validate("verify_sweep", {"max_L": 8.0})
    assert p.name == "verify_sweep" and prm == {"max_L": 8, "repeats": 3, "context": 64}


def test_agents_measure_themselves_and_results_land_per_host(tmp_path):
    a = Agent(AgentConfig(role="proposer", model="tiny:1", key=KEY, advertise=False,
                          allow_peers=LOCAL,
                          name="mac-a", proposer_kinds=("ngram", "layerskip")))
    b = Agent(AgentConfig(role="verifier", model="tiny:1", key=KEY, advertise=False,
                          allow_peers=LOCAL,
                          name="mac-b"))
    try:
        with Client(a.card.router_endpoint, key=KEY) as c:
            r = c.request(RunPreset("draft_cost", {"proposer": "layerskip:2", "tokens": 3}), 60)
            assert isinstance(r, PresetResult)
            d = json.loads(r.result_json)
            assert d["host"] == "mac-a" and d["ms_per_token"] > 0
            with pytest.raises(ProtocolError) as e:
                c.request(RunPreset("nope", {}), 10)
            assert e.value.code == "bad_request"
        reqs = plan_requests(a.card, [b.card])
        assert ("link_probe", {"peer": b.card.router_endpoint}) in reqs
        b_small = [("verify_sweep", {"max_L": 4, "repeats": 1})]
        import macfleet.fleet.profile as prof
        orig = prof.plan_requests
        prof.plan_requests = lambda card, others: b_small + [
            r for r in orig(card, others) if r[0] != "verify_sweep"]
        try:
            written = profile_fleet([a.card, b.card], KEY, tmp_path)
        finally:
            prof.plan_requests = orig
        assert (tmp_path / "mac-a" / "verify_sweep.json").is_file()
        assert (tmp_path / "mac-b" / "verify_sweep.json").is_file()
        link = json.loads(next((tmp_path / "mac-a").glob("link_probe-*.json")).read_text())
        assert link["rtt_ms_p50"] > 0 and link["points"][-1]["bytes"] >= 1 << 20
        assert len(written["mac-a"]) >= 3
    finally:
        a.close()
        b.close()
