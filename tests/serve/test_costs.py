"""The batch's measured costs (serve/costs.py), without a model: a probe and a table given."""

from __future__ import annotations

import pytest

import macfleet.engine.verify_costs as vc
from macfleet.fleet.batch import IterationView
from macfleet.serve.costs import POOL_BLOCKS, BatchCosts


@pytest.fixture
def no_known_table(monkeypatch):
    monkeypatch.setattr(vc, "known_verify_costs", lambda model, **kw: None)


def _it(decode: int, prefill: int, ms: float) -> IterationView:
    return IterationView(0.0, 1, decode, prefill, 0, ms)


def test_nothing_is_priced_before_a_forward_is_measured(no_known_table):
    costs = BatchCosts(object(), 1.5, probe=lambda m: pytest.fail("probed"))
    assert costs.batch_cost() is None
    costs.observe(_it(4, 0, 40.0))  # a decode-only iteration: the batch's own curve
    assert costs.batch_cost()(4) == 40.0


def test_iterations_with_prefill_price_through_the_line_not_the_curve(no_known_table):
    costs = BatchCosts(object(), 1.5, probe=lambda m: {})
    for n, ms in ((10, 20.0), (30, 40.0), (50, 60.0)):
        costs.observe(_it(2, n - 2, ms))
    assert not costs.curve().samples
    assert costs.batch_cost()(20) == pytest.approx(30.0)  # the line 10 + n


def test_the_probe_runs_once_and_then_sizes_prefill_chunks(no_known_table):
    calls = []
    table = {1: 10.0, 8: 11.0, 16: 30.0}
    costs = BatchCosts(object(), 1.5, probe=lambda m: calls.append(m) or table)
    assert costs.chunk_budget(1, 1, 256) == 1 + costs.stall.chunk  # no curve yet: measured
    assert costs.stall.curve is None
    assert costs.verify_costs() is table and costs.verify_costs() is table
    assert len(calls) == 1
    assert costs.stall.curve is not None and costs.stall.curve.cost(8) == 11.0
    # 1 decode token at 10 ms, ratio 1.5: the longest chunk whose iteration the curve prices
    # at <= 15 ms (L = 9: 13.4 ms between 8 and 16; L = 10: 15.8 ms)
    assert costs.chunk_budget(1, 1, 256) == 1 + 8


def test_a_known_table_seeds_the_curves_without_a_probe(monkeypatch):
    monkeypatch.setattr(vc, "known_verify_costs", lambda model, **kw: {1: 5.0, 4: 6.0})
    costs = BatchCosts(object(), 1.5, probe=lambda m: pytest.fail("probed"))
    assert costs.batch_cost()(4) == 6.0


def test_step_time_and_the_acceptance_pool():
    costs = BatchCosts(object(), 1.5, probe=lambda m: {})
    costs.observe_step(10.0)
    costs.observe_step(20.0)
    assert costs.step_ms == pytest.approx(12.0)  # an EMA, 0.2 of the new
    assert costs.pool_totals() == (0, 0)
    for _ in range(POOL_BLOCKS + 1):
        costs.observe_block(3, 2)
    assert costs.pool_totals() == (3 * POOL_BLOCKS, 2 * POOL_BLOCKS)  # the recent ones
