"""Dashboard session metrics from per-block messages (pure)."""

from __future__ import annotations

import pytest

from bridge.messages import BlockMetrics
from macfleet.fleet.metrics import SessionMetrics


def _block(i: int, *, f3_bytes: int = 0, f3_ms: float = 0.0, probe: bool = False,
           remote: bool = True, hidden: int = 576) -> BlockMetrics:
    return BlockMetrics("v", "s", i, 4, 1, 100.0, 5.0, 90.0, 60 if remote else 0,
                        0.3 if remote else 0.0, 40 if remote else 0, 0.2 if remote else 0.0,
                        f3_bytes, f3_ms, probe, hidden)


def _flows(blocks):
    m = SessionMetrics("s", "v")
    for b in blocks:
        m.apply(b, now=0.0)
    return {f.label: f for f in m.view(now=0.0).flows}


def test_f3_row_is_an_estimate_when_no_hidden_state_drafter_runs():
    f = _flows([_block(i) for i in range(4)])
    est = f["F3 est"]
    assert est.estimate and not est.probe
    assert est.bytes_per_block == pytest.approx(2 * 576 * 2)  # 2 committed tokens, float16
    # the F1+F2 round trip's 0.5 ms split by bytes: F3 would take its share
    assert est.ms_per_block == pytest.approx(0.5 * 2304 / (100 + 2304))
    assert est.share_of_block == pytest.approx(est.ms_per_block / 100.0)


def test_real_and_probed_f3_are_labelled_as_such_and_one_host_costs_nothing():
    assert "F3" in _flows([_block(1, f3_bytes=2304, f3_ms=0.4)])
    assert "F3 probe" in _flows([_block(1, f3_bytes=2304, f3_ms=0.4, probe=True)])
    local = _flows([_block(1, remote=False)])["F3 est"]
    assert local.bytes_per_block == 0 and local.ms_per_block == 0


def test_kv_row_shows_a_prompt_shipped_once_by_a_prefill_agent():
    from dataclasses import replace

    blocks = [_block(1), *(_block(i) for i in range(2, 5))]
    assert "KV" not in _flows(blocks)  # prefilled on the verifier: no KV flow
    blocks[0] = replace(blocks[0], kv_bytes=93_000_000, kv_ms=380.0)
    kv = _flows(blocks)["KV"]
    assert kv.bytes_per_block == 93_000_000 and kv.ms_per_block == 380.0
    assert list(_flows(blocks))[-1] == "KV"
