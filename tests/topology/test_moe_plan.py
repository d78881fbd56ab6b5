"""Which way a mixture of experts is sharded (topology/moe.py): a pure choice from memory, link
and expert counts, with the reason in words; the planner uses it for MoE models."""

from __future__ import annotations

from dataclasses import replace

import pytest

from macfleet.topology import Fleet, Host, Link, plan
from macfleet.topology.cost import dispatch_floor_ms
from macfleet.topology.fleet_spec import GB, ModelShape
from macfleet.topology.inputs import tiny_moe_shape
from macfleet.topology.moe import (EXPERT, PIPELINE, ROUTE_ON_HOST_MIN_TOKENS, TENSOR,
                                   RingLatency, choose_moe_mode, collective_bytes, estimate,
                                   expert_time_share)

TINY = tiny_moe_shape("tiny-moe:1")
# a Qwen3-30B-A3B-like shape: 48 layers, 128 experts, 8 per token, experts ~ 95% of the bytes
BIG = ModelShape("moe-30b", param_bytes=60 * GB, layers=48, hidden=2048, heads=32, kv_heads=4,
                 vocab=151936, experts=128, experts_per_tok=8, expert_bytes=57 * GB,
                 expert_intermediate=768)
THUNDERBOLT = Link("a", "b", 0.05, 4000.0)
ETHERNET = Link("a", "b", 1.0, 100.0)


def test_tiny_moe_shape_is_the_built_model():
    from mlx.utils import tree_flatten

    from macfleet.engine.models import load_model

    model = load_model("tiny-moe:1").model
    flat = dict(tree_flatten(model.parameters()))
    assert TINY.param_bytes == sum(w.nbytes for w in flat.values())
    assert TINY.expert_bytes == sum(w.nbytes for k, w in flat.items() if "switch_mlp" in k)
    assert (TINY.experts, TINY.experts_per_tok, TINY.layers) == (8, 2, 4)


def test_collective_bytes_per_mode():
    s = 5 * 64 * 4  # 5 tokens x hidden x float32
    assert collective_bytes(TINY, EXPERT, 2, 5) == 4 * s  # 1 all_sum per MoE layer
    assert collective_bytes(TINY, TENSOR, 2, 5) == 8 * s  # 2 per layer
    assert collective_bytes(TINY, PIPELINE, 4, 5) == 3 * s + 5 * 64 * 4  # hops + logits
    assert collective_bytes(TINY, EXPERT, 1, 5) == 0


def test_expert_memory_is_replicated_part_plus_a_share_of_experts():
    e = estimate(BIG, EXPERT, 4, [64 * GB] * 4, THUNDERBOLT, 30.0)
    t = estimate(BIG, TENSOR, 4, [64 * GB] * 4, THUNDERBOLT, 30.0)
    assert e.mem_per_rank > t.mem_per_rank  # attention and routers are on every rank
    assert e.mem_per_rank < BIG.param_bytes / 2


def test_slow_link_picks_pipeline_and_says_why():
    c = choose_moe_mode(BIG, 2, [48 * GB, 48 * GB], ETHERNET, 30.0, tokens=1)
    assert c.mode == PIPELINE
    assert "pipeline over 2" in c.reason and "tensor" in c.reason and "expert" in c.reason
    by = {e.mode: e for e in c.estimates}
    # per forward, expert moves half of tensor's bytes and pays half its all-reduces
    assert by[EXPERT].bytes_per_forward * 2 == by[TENSOR].bytes_per_forward
    assert by[EXPERT].comm_ms < by[TENSOR].comm_ms


def test_fast_link_and_a_verify_block_pick_expert_when_tensor_cannot_split():
    odd = replace(BIG, kv_heads=4, heads=32)  # 3 ranks: kv heads 4 do not divide
    c = choose_moe_mode(odd, 3, [48 * GB] * 3, THUNDERBOLT, 80.0, tokens=16)
    by = {e.mode: e for e in c.estimates}
    assert not by[TENSOR].possible and "not divisible by 3" in by[TENSOR].why_not
    assert c.mode == EXPERT, c.reason  # a 16-token block reads most experts: split them
    assert expert_time_share(odd, 16) > 0.9


def test_fast_link_single_token_prefers_tensor():
    c = choose_moe_mode(BIG, 2, [48 * GB] * 2, Link("a", "b", 0.005, 10000.0), 30.0, tokens=1)
    assert c.mode == TENSOR, c.reason


def test_nothing_fits_says_so():
    c = choose_moe_mode(BIG, 2, [8 * GB, 8 * GB], THUNDERBOLT, 30.0)
    assert c.mode == "" and "does not fit" in c.reason


def test_measured_ring_latency_prices_collectives():
    slow = choose_moe_mode(TINY, 2, [GB, GB], Link("a", "b", 0.0, 1e6), 0.6,
                           ring=RingLatency(allreduce_ms=5.0, hop_ms=0.1))
    assert slow.mode == PIPELINE
    fast = choose_moe_mode(TINY, 2, [GB, GB], Link("a", "b", 0.0, 1e6), 6.0,
                           ring=RingLatency(allreduce_ms=0.01, hop_ms=2.0))
    assert fast.mode == TENSOR, fast.reason


def test_the_dispatch_floor_is_what_weight_reads_do_not_explain():
    assert dispatch_floor_ms(2.0, 2e6, 10.0) == pytest.approx(1.8)  # 2 MB at 10 GB/s: 0.2 ms
    assert dispatch_floor_ms(30.0, 60e9, 400.0) == 0.0  # bandwidth-bound: nothing left over
    assert dispatch_floor_ms(2.0, 2e6, None) == 0.0  # unknown chip: the whole forward splits


def test_a_dispatch_bound_model_splits_no_compute_so_collectives_rank_the_modes():
    """Every rank of a tensor or expert group runs every layer's ops: a forward that is all
    dispatch (a tiny model) is not divided, and the mode with the fewest collectives wins."""
    link, ring = Link("a", "b", 0.0, 1e6), RingLatency(allreduce_ms=0.12, hop_ms=0.06)
    bound = {e.mode: e for e in choose_moe_mode(TINY, 2, [GB, GB], link, 2.0, ring=ring,
                                                floor_ms=2.0).estimates}
    assert {round(e.compute_ms, 9) for e in bound.values()} == {2.0}
    assert [m for m in bound] == [PIPELINE, EXPERT, TENSOR]  # 2 hops < 4 < 8 all-reduces
    split = estimate(TINY, TENSOR, 2, [GB, GB], link, 2.0, ring=ring)  # no floor known
    assert split.compute_ms == pytest.approx(1.0)


def test_host_syncs_are_priced_only_where_expert_mode_routes_on_the_host():
    """Decode and verify blocks route on the device (no sync); a prefill chunk of
    ROUTE_ON_HOST_MIN_TOKENS or more reads the router's choice once per MoE layer."""
    link = Link("a", "b", 0.0, 1e6)
    n = ROUTE_ON_HOST_MIN_TOKENS
    for tokens, syncs in ((1, 0), (n - 1, 0), (n, 4)):
        with_sync = estimate(TINY, EXPERT, 2, [GB, GB], link, 1.0, tokens, sync_ms=0.5)
        no_sync = estimate(TINY, EXPERT, 2, [GB, GB], link, 1.0, tokens, sync_ms=0.0)
        assert with_sync.compute_ms - no_sync.compute_ms == pytest.approx(syncs * 0.5)


def test_planner_shards_a_moe_with_the_chosen_mode_and_explains():
    hosts = tuple(Host(f"m{i}", "M2 Max", 40 * GB) for i in range(3))
    fleet = Fleet(hosts, BIG, links=(), default_link=THUNDERBOLT)
    sharded = [q for q in plan(fleet, proposer="ngram") if q.shard_mode and q.feasible]
    assert sharded
    for q in sharded:
        assert any(n.startswith("MoE: ") and q.shard_mode in n for n in q.notes), q.notes
    expert = [q for q in sharded if q.shard_mode == EXPERT]
    for q in expert:
        assert all("experts" in r.role for r in q.placement if r.role.startswith("shard"))
