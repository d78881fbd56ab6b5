"""One formatter and one JSON form for a run's statistics, in-process and through agents."""

from __future__ import annotations

import io
import json

from macfleet.cli import where
from macfleet.cli.cmd_generate import print_stats, result_json
from macfleet.stats import FleetStats, FlowStats, GenerationStats, ProposerStats

LOCAL = GenerationStats(tokens=20, elapsed_s=2.0, prefill_ms=500.0, blocks=5, drafted=16,
                        accepted=12, proposer="ngram", finish_reason="stop",
                        accepted_hist=(1, 0, 1, 3),
                        per_proposer=(ProposerStats("ngram", 10, 9), ProposerStats("x", 6, 3)))
FLEET = GenerationStats(
    tokens=20, elapsed_s=2.0, blocks=5, drafted=16, accepted=12, proposer="ngram",
    fleet=FleetStats(verifier="n1", verifier_agent="mac-a", proposer_agents=("mac-b",),
                     proposer_failures=1, wire_ms=10.0, multihost_overhead=0.05,
                     flows=FlowStats(remote_blocks=5, f1_bytes_per_block=40.0,
                                     f2_bytes_per_block=60.0, predraft_hit_rate=0.5)))

HERE = where.asked_local()


def _printed(stats: GenerationStats) -> str:
    out = io.StringIO()
    print_stats(stats, file=out)
    return out.getvalue()


def test_local_run_prints_rates_and_each_tree_drafter():
    text = _printed(LOCAL)
    assert "20 tokens in 2.00s: 10.0 tok/s (decode 13.3)" in text
    assert "proposer ngram |" in text and "acceptance 75%" in text
    assert "acceptance[ngram]: 0.900" in text and "acceptance[x]: 0.500" in text
    assert "verifier" not in text and "flows/block" not in text


def test_fleet_run_prints_where_it_ran_and_the_flows():
    text = _printed(FLEET)
    assert "proposer ngram on mac-b" in text
    assert "verifier mac-a | proposer failures 1" in text
    assert "flows/block: F1 40 B" in text and "multi-host overhead 5.0%" in text
    assert "pre-draft hits 50%" in text


def test_json_nests_the_records_and_adds_the_rates():
    doc = json.loads(result_json(FLEET, "hi", [1, 2], HERE))
    assert doc["text"] == "hi" and doc["token_ids"] == [1, 2]
    st = doc["stats"]
    assert st["tokens_per_s"] == 10.0 and st["acceptance"] == 0.75
    assert st["fleet"]["verifier_agent"] == "mac-a" and st["fleet"]["proposer_agents"] == ["mac-b"]
    assert st["fleet"]["flows"]["remote_blocks"] == 5
    loc = json.loads(result_json(LOCAL, "", [], HERE))["stats"]
    assert loc["where"] == HERE.to_dict()
    assert loc["fleet"] is None
    assert loc["per_proposer"][0] == {"name": "ngram", "drafted": 10, "accepted": 9,
                                      "acceptance": 0.9}
    assert loc["mean_accepted"] == (2 * 1 + 3 * 3) / 5


def test_fleet_run_prints_the_kv_flow_where_and_why():
    from dataclasses import replace

    from macfleet.stats import KVFlow

    kv = KVFlow(where="remote", reason="2000 tokens: frees ~1900 ms", agent="tcp://h:1",
                tokens=1999, codec="auto", kv_bytes=92_000_000, kv_ms=900.0, prefill_ms=800.0,
                install_ms=40.0)
    text = _printed(replace(FLEET, fleet=replace(FLEET.fleet, kv=kv)))
    assert ("flow KV: prefill remote on tcp://h:1: 1999 tokens, 92.0 MB (auto) in 900 ms "
            "(agent compute 800 ms, install 40 ms) | 2000 tokens: frees ~1900 ms") in text
    assert "flow KV" not in _printed(FLEET)  # a plain request: nothing to say
    doc = json.loads(result_json(replace(FLEET, fleet=replace(FLEET.fleet, kv=kv)), "", [], HERE))
    assert doc["stats"]["fleet"]["kv"]["kv_bytes"] == 92_000_000
