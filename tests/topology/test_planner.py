"""The planner: memory fit, the refusal, monotone predictions, tensor vs pipeline choice."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from macfleet.topology import (N_TO_ONE, ONE_TO_N, ONE_TO_ONE, SHARDED, SINGLE, SPLIT_SEQUENCE,
                               Fleet, Host, Link, Profile, ProposerProfile, SnapshotError,
                               layer_ranges, plan, shard_mode, snapshot_from_dict)
from macfleet.topology.cost import expected_tokens, expected_tokens_tree
from macfleet.topology.fleet_spec import GB, SMOLLM2

EXAMPLE = Path(__file__).parents[2] / "macfleet/topology/examples/desk-8-macs.json"


def fleet(*mems_gb: float, rtt: float = 1.0, alpha: float = 0.6) -> Fleet:
    hosts = tuple(Host(f"h{i}", "", int(m * GB)) for i, m in enumerate(mems_gb))
    prof = Profile(proposers=(ProposerProfile("draft", 4.0, alpha, 0.15),))
    return Fleet(hosts, SMOLLM2, prof, default_link=Link("*", "*", rtt, 100.0))


def by(plans, topo, n=None):
    return next(q for q in plans if q.topology == topo and (n is None or q.n == n))


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens_tree(0.5, 3, 1) == pytest.approx(expected_tokens(0.5, 3))
    assert expected_tokens_tree(0.5, 3, 3) > expected_tokens(0.5, 3)


def test_memory_fit_excludes_a_host():
    f = fleet(8, 0.2)  # h1 cannot hold the verifier (0.67 GB with overhead)
    plans = plan(f)
    single = by(plans, SINGLE)
    assert single.feasible and [r.host for r in single.placement] == ["h0"]
    one = by(plans, ONE_TO_ONE)
    assert one.feasible
    assert next(r.host for r in one.placement if r.role == "verifier") == "h0"
    assert all(r.fits for q in plans if q.feasible for r in q.placement)


def test_nothing_fits_means_shard():
    plans = plan(fleet(0.4, 0.4, 0.4))
    assert not by(plans, SINGLE).feasible
    assert "GB free" in by(plans, ONE_TO_ONE).reason
    sh = [q for q in plans if q.topology == SHARDED and q.feasible]
    assert sh and all(r.fits for q in sh for r in q.placement)
    assert plans[0].topology == SHARDED  # the fastest feasible one comes first


def test_split_sequence_is_refused_with_the_reason():
    q = by(plan(fleet(8, 8)), SPLIT_SEQUENCE)
    assert not q.feasible and q.tokens_per_s == 0
    assert "causal" in q.reason and "token N+1" in q.reason
    assert q is not None and plan(fleet(8), topologies=(SPLIT_SEQUENCE,))[0].reason == q.reason


@pytest.mark.parametrize("topo", [SINGLE, ONE_TO_ONE, N_TO_ONE, ONE_TO_N, SHARDED])
def test_monotone_in_acceptance(topo):
    tps = [by(plan(fleet(8, 8, 8, alpha=a)), topo).tokens_per_s for a in (0.2, 0.5, 0.8, 0.95)]
    assert tps == sorted(tps) and tps[-1] > tps[0]


@pytest.mark.parametrize("topo", [ONE_TO_ONE, N_TO_ONE, SHARDED])
def test_monotone_in_rtt(topo):
    tps = [by(plan(fleet(8, 8, 8, rtt=r)), topo).tokens_per_s for r in (0.1, 1, 5, 20)]
    assert tps == sorted(tps, reverse=True) and tps[0] > tps[-1]


def test_tensor_vs_pipeline_for_smollm2():
    assert shard_mode(SMOLLM2, 3) == "tensor"  # 9 heads, 3 kv heads, 1536 MLP: all divide
    assert shard_mode(SMOLLM2, 2) == "pipeline"  # 9 heads do not split in two
    plans = plan(fleet(8, 8, 8))
    assert by(plans, SHARDED, 3).shard_mode == "tensor"
    p2 = by(plans, SHARDED, 2)
    assert p2.shard_mode == "pipeline"
    assert [r.role for r in p2.placement][:2] == ["shard 1/2 (layers 0-14)",
                                                  "shard 2/2 (layers 15-29)"]
    assert layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_sessions_buy_throughput_not_latency():
    plans = plan(fleet(8, 8, 8, 8))
    s = by(plans, ONE_TO_N, 3)
    assert s.tokens_per_s > by(plans, ONE_TO_ONE).tokens_per_s
    assert s.per_session_tokens_per_s <= by(plans, ONE_TO_ONE).tokens_per_s


def test_example_desk_parses_and_needs_sharding():
    f = snapshot_from_dict(json.loads(EXAMPLE.read_text()))
    assert len(f.hosts) == 8
    plans = plan(f)
    assert plans[0].topology == SHARDED and plans[0].feasible
    assert not by(plans, SINGLE).feasible


def test_bad_snapshot_names_the_field():
    with pytest.raises(SnapshotError, match="hosts"):
        snapshot_from_dict({"hosts": []})
    with pytest.raises(SnapshotError, match=r"links\[0\]"):
        snapshot_from_dict({"hosts": [{"name": "a"}], "links": [{"a": "a", "b": "zz"}]})


def test_plans_are_frozen():
    q = plan(fleet(8))[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.tokens_per_s = 1.0  # type: ignore[misc]
