"""Expert parallelism's MoE block in one process: the ranks' partial sums add up to mlx-lm's own
block, non-local experts are dropped from each rank's weights, the router's load is counted."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from agents.expert import ExpertParallelMoE, RouterLoad, expert_range, shard_experts
from macfleet.engine.tiny import build_tiny_moe
from macfleet.topology.moe import ROUTE_ON_HOST_MIN_TOKENS
from tolerance import LOGIT_ATOL


def test_expert_ranges_cover_every_expert_once():
    for e, n in ((8, 2), (8, 3), (8, 4), (6, 4)):
        spans = [expert_range(e, n, r) for r in range(n)]
        assert spans[0][0] == 0 and spans[-1][1] == e
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


@pytest.mark.parametrize("tokens", [7, ROUTE_ON_HOST_MIN_TOKENS])  # on the device, on the host
@pytest.mark.parametrize("n", [2, 4])
def test_partials_sum_to_the_whole_block(n, tokens):
    x = mx.random.normal((1, tokens, 64), key=mx.random.key(3))
    partials, loads = [], []
    for r in range(n):
        model = build_tiny_moe(1)  # a fresh copy per rank: each keeps only its experts
        block = model.model.layers[0].mlp
        want = block(x)
        load = RouterLoad(8)
        ep = ExpertParallelMoE(block, None, expert_range(8, n, r), load, reduce=lambda p: p)
        assert ep.switch_mlp.up_proj.weight.shape[0] == 8 // n
        partials.append(ep(x))
        mx.eval(partials[-1])
        load.flush()
        loads.append(load)
    got = sum(partials[1:], partials[0])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=LOGIT_ATOL, rtol=0)
    # every rank routes the same way (replicated router): each counted its tokens x 2 slots
    assert all(ld.per_expert.sum() == tokens * 2 for ld in loads)
    assert all((ld.per_expert == loads[0].per_expert).all() for ld in loads)
    assert all(ld.collective_bytes == tokens * 64 * 4 for ld in loads)  # one all_sum, [L, D]


def test_a_decode_block_waits_for_nothing_on_the_host():
    """Few tokens route on the device: the block returns an unevaluated graph (its all_sum
    inside it), counts the router's choices only at flush, and times no collective."""
    x = mx.random.normal((1, 3, 64), key=mx.random.key(5))
    load = RouterLoad(8)
    ep = ExpertParallelMoE(build_tiny_moe(1).model.layers[0].mlp, None, expert_range(8, 2, 0),
                           load, clock=lambda: pytest.fail("the device path read the clock"),
                           reduce=lambda p: p)
    y = ep(x)
    assert load.per_expert.sum() == 0  # nothing read back yet
    mx.eval(y)
    load.flush()
    assert load.per_expert.sum() == 3 * 2 and load.collective_ms == 0.0
    load.flush()  # counted once
    assert load.per_expert.sum() == 3 * 2


def test_shard_experts_refuses_a_dense_model():
    from macfleet.engine.tiny import build_tiny_model

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 0

    with pytest.raises(ValueError, match="mixture-of-experts"):
        shard_experts(build_tiny_model(1), Group())


def test_a_quantized_block_keeps_its_experts_scales():
    import mlx.nn as nn

    x = mx.random.normal((1, 5, 64), key=mx.random.key(4))
    parts = []
    for r in range(2):
        model = build_tiny_moe(1)
        nn.quantize(model, group_size=32, bits=8)
        block = model.model.layers[0].mlp
        want = block(x)
        ep = ExpertParallelMoE(block, None, expert_range(8, 2, r), reduce=lambda p: p)
        up = ep.switch_mlp.up_proj
        assert up.weight.shape[0] == up.scales.shape[0] == up.biases.shape[0] == 4
        parts.append(ep(x))
    np.testing.assert_allclose(np.array(parts[0] + parts[1]), np.array(want),
                               atol=LOGIT_ATOL, rtol=0)
