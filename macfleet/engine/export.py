"""Write a loaded llama-family model as an mlx-lm model directory (config, safetensors, tokenizer).

Other tools (`mlx_lm.server`, the baseline of `macfleet bench serve`) load mlx-lm directories,
not our GGUF. The weights are written as loaded, so `mlx_lm.load(dir)` gives macfleet's logits.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from macfleet.engine.models import LoadedModel


class ExportError(ValueError):
    """The model cannot be written as an mlx-lm directory (the message says why)."""


def export_mlx_lm(lm: LoadedModel, out: Path) -> Path:
    tok = getattr(lm.tokenizer, "_tokenizer", None)
    if tok is None or not hasattr(tok, "save_pretrained"):
        raise ExportError(f"{lm.spec} has no Hugging Face tokenizer to write (tiny models "
                          "use a test tokenizer)")
    if lm.quantized:
        raise ExportError("export dense weights (e.g. smollm2:dense): quantized GGUF tensors "
                          "are not in mlx-lm's quantization layout")
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(lm.model.args).items() if v is not None}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = dict(tree_flatten(lm.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights,
                        metadata={"format": "mlx", "source": lm.source})
    tok.save_pretrained(str(out))
    return out
