"""`bench serve --head-to-head`: macfleet and mlx_lm.server up together, alternating rounds."""

from __future__ import annotations

import time

import pytest

from macfleet.engine.models import embedded_model_path


@pytest.mark.slow  # two real servers on the embedded model
def test_head_to_head_alternates_rounds_against_a_real_mlx_lm_server(tmp_path):
    if embedded_model_path() is None:
        pytest.skip("the embedded model is not installed")
    from macfleet.bench.serve import head_to_head
    from macfleet.engine.export import export_mlx_lm
    from macfleet.engine.models import load_model

    out = export_mlx_lm(load_model("smollm2:dense"), tmp_path / "smol")
    res = head_to_head("smollm2", str(out), clients=2, max_tokens=4, rounds=2,
                       deadline=time.monotonic() + 300, progress=lambda s: None)
    assert [r["first"] for r in res["rounds"]] == ["macfleet", "mlx_lm"]  # the order flips
    assert res["failed"] == 0
    for r in res["rounds"]:
        for side in ("macfleet", "mlx_lm"):
            assert r[side]["ok"] == 2 and r[side]["tokens"] == 8
    assert res["summary"]["rounds"] == 2 and res["summary"]["ratio_min"] > 0
