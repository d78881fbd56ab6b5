"""Pure parts of the f3 / sessions / topologies benches (no agents, no MLX work)."""

from __future__ import annotations

import pytest

from macfleet.bench.f3 import (Point, f3_payload_bytes, interp_loglog, percentile,
                               real_payloads)
from macfleet.bench.sessions import fairness


def test_f3_payload_bytes_is_hidden_x_layers_x_tokens_x_fp16():
    assert f3_payload_bytes(576, 1, 1) == 1152  # SmolLM2, EAGLE, one accepted token
    assert f3_payload_bytes(4096, 3, 4) == 98_304  # 8B, EAGLE-3, 4 tokens
    assert f3_payload_bytes(8192, 3, 5) == 245_760  # 70B, EAGLE-3, 5 tokens
    assert f3_payload_bytes(8192, 1, 1, dtype_bytes=4) == 32_768
    with pytest.raises(ValueError):
        f3_payload_bytes(-1, 1, 1)


def test_real_payloads_cover_every_verifier_drafter_and_token_count():
    rs = real_payloads()
    assert len(rs) == 3 * 2 * 5
    assert min(r.nbytes for r in rs) == 1152 and max(r.nbytes for r in rs) == 245_760


def test_interp_loglog_hits_points_and_is_linear_in_log_log():
    pts = [Point(1000, 1.0, 1.0, 1.0, 1), Point(100_000, 100.0, 100.0, 100.0, 1)]
    assert interp_loglog(pts, 1000) == 1.0
    assert interp_loglog(pts, 10_000) == pytest.approx(10.0)
    assert interp_loglog(pts, 10) == 1.0 and interp_loglog(pts, 1e9) == 100.0  # clamped


def test_percentile_nearest_rank():
    xs = list(range(1, 21))
    assert percentile(xs, 95) == 19 and percentile(xs, 50) == 10 and percentile(xs, 100) == 20


def test_fairness():
    assert fairness([2.0, 2.0])["jain_index"] == 1.0
    f = fairness([1.0, 3.0])
    assert f["min_over_max"] == pytest.approx(0.333, abs=1e-3) and f["jain_index"] == 0.8
