"""A sharded verifier's shard flow and router load, from its BlockMetrics to the dashboard:
the per-block delta of the generation's tally (agents/shard_traffic.py), folded into a "shard"
flow row and a per-rank load in the session view, shown under the flows panel."""

from __future__ import annotations

import pytest

from agents.shard_traffic import BlockShard, ShardTraffic, block_delta
from bridge.messages import BlockMetrics
from macfleet.fleet.metrics import SessionMetrics
from macfleet.fleet.snapshot import SessionView
from macfleet.stats import ShardStats
from macfleet.topology.moe import ring_rounds


def block(i: int, **shard) -> BlockMetrics:
    return BlockMetrics(node_id="v", session_id="s", block=i, k=2, accepted=1, block_ms=10.0,
                        draft_ms=1.0, verify_ms=8.0, f1_bytes=10, f1_ms=0.1, f2_bytes=20,
                        f2_ms=0.2, f3_bytes=0, f3_ms=0.0, probe=False, hidden_size=64, **shard)


def test_block_delta_is_what_the_block_added():
    a = ShardStats(mode="expert", ranks=2, collective_bytes=1000, collective_ms=1.0,
                   priced_ms=0.4, rank_load=(10, 6))
    b = ShardStats(mode="expert", ranks=2, collective_bytes=1768, collective_ms=1.5,
                   priced_ms=0.6, rank_load=(13, 9))
    assert block_delta(None, a) == BlockShard(1000, 1.0, 0.4, (10, 6))
    d = block_delta(a, b)
    assert (d.bytes, d.ms, d.rank_load) == (768, 0.5, (3, 3))
    assert d.priced_ms == pytest.approx(0.2)
    assert block_delta(a, None) == BlockShard(0, 0.0, 0.0, ())


def test_every_mode_prices_its_collectives_at_the_rings_measured_latency():
    """Collectives run inside the forward's graph, untimed: each mode's are priced, in small
    ring all-reduces, at the median of rank 0's command broadcasts."""
    assert ring_rounds("tensor", 2, layers=4, moe_layers=0, want_logits=True) == 8.0
    assert ring_rounds("expert", 4, layers=4, moe_layers=4, want_logits=True) == 4.0
    # a pipeline's hops (3 boundaries + the logits back over 4 ranks) are ring steps of 6
    assert ring_rounds("pipeline", 4, layers=1, moe_layers=0, want_logits=True) == 4 / 6
    assert ring_rounds("pipeline", 2, layers=2, moe_layers=0, want_logits=False) == 0.5
    assert ring_rounds("tensor", 1, layers=4, moe_layers=0, want_logits=True) == 0.0
    t = ShardTraffic("tensor", 2, 64)
    t.forward(1, 512, 3.0, rounds=8.0)  # nothing measured yet: priced at 0
    for ms in (0.1, 0.3, 0.2):
        t.command(ms)
    t.command()  # a follower's broadcast times nothing
    t.forward(1, 512, 3.0, rounds=8.0)
    st = t.stats()
    assert st.priced_ms == pytest.approx(8 * 0.2) and st.control_bytes == 4 * 64
    t.reset()
    t.forward(1, 512, 3.0, rounds=8.0)  # the latency is the ring's: kept across generations
    assert t.stats().priced_ms == pytest.approx(1.6) and t.stats().forwards == 1


def test_a_priced_shard_flow_is_marked_as_such():
    m = SessionMetrics("s", "v")
    m.apply(block(1, shard_bytes=1024, shard_ms=0.8, shard_priced=True), now=1.0)
    sh = m.view(now=1.1).flow("shard")
    assert sh is not None and sh.ms_per_block == 0.8 and sh.estimate and sh.label == "shard est"
    timed = SessionMetrics("s", "v")
    timed.apply(block(1, shard_bytes=1024, shard_ms=0.8), now=1.0)
    assert not timed.view(now=1.1).flow("shard").estimate


def test_session_view_has_a_shard_flow_and_rank_load():
    m = SessionMetrics("s", "v")
    m.apply(block(1, shard_bytes=768, shard_ms=0.5, rank_load=(3, 3)), now=1.0)
    m.apply(block(2, shard_bytes=1024, shard_ms=1.5, rank_load=(5, 3)), now=1.1)
    v = m.view(now=1.2)
    sh = v.flow("shard")
    assert sh is not None and sh.bytes_per_block == 896 and sh.ms_per_block == 1.0
    assert v.rank_load == (8, 6)
    assert SessionView.from_dict(v.to_dict()) == v


def test_without_shards_nothing_changes():
    m = SessionMetrics("s", "v")
    m.apply(block(1), now=1.0)
    v = m.view(now=1.1)
    assert v.flow("shard") is None and v.rank_load == ()
    assert "rank_load" not in v.to_dict()


def test_flows_panel_summary_names_the_router_load():
    from tui.widgets.flows import compute_summary

    m = SessionMetrics("s", "v")
    m.apply(block(1, shard_bytes=768, shard_ms=0.5, rank_load=(3, 5)), now=1.0)
    assert "router load per rank 3 / 5 tokens" in compute_summary(m.view(now=1.1))
