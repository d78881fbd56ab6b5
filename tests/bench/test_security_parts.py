"""`macfleet bench security --only faults|flood` re-measures one part and merges it into
results/security.json, keeping every other figure; the ring cut says why when it is skipped."""

from __future__ import annotations

import json
from types import SimpleNamespace

from macfleet.bench import f3, faults, fuzz
from macfleet.cli.bench_f3 import run_security

OLD = {"encryption": {"by_size": [1, 2]},
       "fuzz": {"doors": {"verifier": {"crashes": 0, "hangs": 0}},
                "faults": {"verifier_sigkill": {"outcome": "old"}},
                "idle_flood": {"crash": False, "hang": False, "summary": "old"},
                "totals": {"messages": 10, "crashes": 0, "hangs": 0}},
       "commands": {"encryption": "e", "fuzz": "f"}}

FLOOD = {"connections": 100, "cap_per_address": 64, "kept_from_one_address": 64,
         "summary": "100 connections from one address -> 64 kept", "crash": False,
         "hang": True, "ping_from": "127.0.0.2", "ping_ms_during": 1.0,
         "shed_after_handshake_deadline": 100}


def run(tmp_path, monkeypatch, part: str, result: dict) -> dict:
    (tmp_path / "security.json").write_text(json.dumps(OLD))
    monkeypatch.setattr(fuzz, "one_part", lambda p, progress=None: result if p == part else {})
    args = SimpleNamespace(only=part, out=tmp_path, max_mib=1, repeats=1, messages=1)
    assert run_security(args) == 0
    return json.loads((tmp_path / "security.json").read_text())


def test_only_faults_replaces_the_faults_and_keeps_the_rest(tmp_path, monkeypatch):
    new = {"ring_cut": {"outcome": "error: unavailable", "seconds_after_fault": 3.0,
                        "tokens_received": 16}}
    doc = run(tmp_path, monkeypatch, "faults", new)
    assert doc["fuzz"]["faults"] == new
    assert doc["encryption"] == OLD["encryption"]
    assert {k: v for k, v in doc["fuzz"].items() if k != "faults"} == {
        k: v for k, v in OLD["fuzz"].items() if k != "faults"}
    assert doc["commands"]["encryption"] == "e" and "fuzz.faults" in doc["commands"]


def test_only_flood_replaces_the_flood_and_its_share_of_the_totals(tmp_path, monkeypatch):
    doc = run(tmp_path, monkeypatch, "flood", FLOOD)
    assert doc["fuzz"]["idle_flood"] == FLOOD
    assert doc["fuzz"]["totals"] == {"messages": 10, "crashes": 0, "hangs": 1}
    assert doc["fuzz"]["faults"] == OLD["fuzz"]["faults"]


def test_ring_cut_says_why_it_was_skipped(monkeypatch):
    monkeypatch.setattr(f3, "load_testbed", lambda: (None, "needs root"))
    assert faults.ring_cut() == {"skipped": "multi-host test bed unavailable: needs root"}


def test_only_closed_adds_the_closed_fleet_cases_and_keeps_the_rest(tmp_path, monkeypatch):
    from macfleet.bench import closed_fleet

    (tmp_path / "security.json").write_text(json.dumps(OLD))
    res = {"what": "w", "ssrf": {"generate_reply": "forbidden", "ping_success": 1.0,
                                 "ping_ms_median": 1.0, "ping_ms_max": 2.0}}
    monkeypatch.setattr(closed_fleet, "closed_fleet", lambda progress=None: res)
    args = SimpleNamespace(only="closed", out=tmp_path, max_mib=1, repeats=1, messages=1)
    assert run_security(args) == 0
    doc = json.loads((tmp_path / "security.json").read_text())
    assert doc["closed_fleet"] == res
    assert doc["encryption"] == OLD["encryption"] and doc["fuzz"] == OLD["fuzz"]
    assert "closed_fleet" in doc["commands"]
    (tmp_path / "security.json").write_text(json.dumps({**doc, "commands": {}}))
    args.only = "encryption"  # re-running another part keeps these figures
    monkeypatch.setattr("macfleet.bench.security.encryption_cost", lambda **kw: {
        "by_size": [], "block_ms": 1, "block_ms_source": "x", "smollm2_flows": []})
    assert run_security(args) == 0
    assert json.loads((tmp_path / "security.json").read_text())["closed_fleet"] == res


def test_only_third_adds_its_cases_and_one_case_keeps_the_others(tmp_path, monkeypatch):
    from macfleet.bench import third_pass

    (tmp_path / "security.json").write_text(json.dumps(OLD))
    full = {"what": "w", "replayed_cards": {"answered": 3}, "grammar_past_limits": {"status": 400},
            "message_flood": {"flood": {}}, "cache_per_key": {"b_same_prompt": 0}}
    monkeypatch.setattr(third_pass, "third_pass",
                        lambda progress=None, parts=(): {k: v for k, v in full.items()
                                                         if k == "what" or k in parts})
    args = SimpleNamespace(only="third", out=tmp_path, max_mib=1, repeats=1, messages=1,
                           case=None)
    assert run_security(args) == 0
    doc = json.loads((tmp_path / "security.json").read_text())
    assert doc["third_pass"] == full and doc["encryption"] == OLD["encryption"]
    args.case = ["grammar_past_limits"]
    full["grammar_past_limits"] = {"status": 400, "param": "response_format.grammar"}
    assert run_security(args) == 0
    doc = json.loads((tmp_path / "security.json").read_text())
    assert doc["third_pass"] == full and "third_pass.grammar_past_limits" in doc["commands"]
