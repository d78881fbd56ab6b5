"""`macfleet export`: the embedded model as an mlx-lm directory that mlx-lm loads to the same
logits and the same chat-template ids (the offline baseline for `bench serve --mlx-lm`)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from macfleet.engine.export import ExportError, export_mlx_lm
from macfleet.engine.models import embedded_model_path, load_model


def test_tiny_models_cannot_be_exported(tmp_path):
    with pytest.raises(ExportError, match="tokenizer"):
        export_mlx_lm(load_model("tiny:1"), tmp_path / "x")


@pytest.mark.slow
def test_export_loads_in_mlx_lm_with_the_same_logits(tmp_path):
    if embedded_model_path() is None:
        pytest.skip("the embedded model is not installed")
    import mlx_lm

    lm = load_model("smollm2:dense")
    out = export_mlx_lm(lm, tmp_path / "smol")
    model, tok = mlx_lm.load(str(out))
    msgs = [{"role": "user", "content": "Name a colour."}]
    ids = list(lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    assert list(tok.apply_chat_template(msgs, add_generation_prompt=True)) == ids
    assert set(tok.eos_token_ids) == set(lm.eos_ids)
    x = mx.array(ids)[None]
    from macfleet.engine import fastmath

    fastmath.install(model)  # the same arithmetic as macfleet's load (the CPU's SiLU): bits
    assert mx.array_equal(lm.model(x), model(x))
