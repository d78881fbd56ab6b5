"""A big verifier built from the embedded SmolLM2-135M: the measuring instrument of issue 42's
draft-model regime (`macfleet bench pair`). A benchmark's instrument, never a model offered to
users: its answers are SmolLM2's, perturbed on purpose.

No big weights can be downloaded here, so one is built that behaves like one, as an ordinary
mlx-lm directory (`mlx_lm.load` and macfleet's `load_model(path)` both read it):

* **wide**: every MLP's intermediate size zero-padded (1536 -> `width`: gate/up rows and down
  columns of zeros). The same function, more bytes read per token: a big model's
  bandwidth-bound regime, where verify(L) grows slowly with L.
* **deep, with a dial**: `extra_layers` decoder layers appended after the last one (before the
  final norm), seeded random weights, built at the model's own MLP width and zero-padded like
  the rest (so they cost like real layers, and the verifier's function does not depend on
  `width`: the dial is calibrated once, at any width). Their output projections (o_proj,
  down_proj) are scaled by `eps` times the residual stream's typical RMS at the last layer
  (`residual_rms`, measured on a fixed text), so each extra layer moves the residual by about
  eps of its own size: the real SmolLM2-135M as a draft model agrees with the verifier less
  often as eps grows, and eps = 0 makes the extra layers exact identities. (Scaled by eps
  alone, as first tried, eps = 2 on 10 layers barely moved acceptance: the residual there has
  an RMS of ~30, with outliers in the thousands.)

A second dial moves the draft model instead (`noisy_weights`, `build_pair_draft`): seeded
gaussian noise of `noise` times each weight matrix's own RMS added to the SmolLM2 draft. The
layer dial reaches acceptance ~0.8 with a verifier that still writes ordinary text (eps 0.14),
but below that the verifier itself degenerates (eps 0.56, measured at 0.57 acceptance: "reproduce
reproduce reproduce ..."; its drafts are accepted because repetition is easy to predict), which
is no user's regime. With the draft dial the verifier stays exactly SmolLM2 (wide, eps 0) and
writes what SmolLM2 writes; only the draft is worse, as a smaller same-family draft is.

The transformations are pure functions of a weight dict and a config dict (`pad_mlp`,
`append_layers`), so a tiny random llama (engine/tiny.py) tests the same code as the real
model. `build_pair_verifier` writes the result under macfleet's cache dir, keyed by every
parameter and a format version, atomically. Calibration (`agreement`, `calibrate`) and the cost
ratio live in bench/pair_dial.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama

from macfleet.engine.cachedir import cache_root

FORMAT_VERSION = 1
DRAFT_SPEC = "smollm2:dense"  # the draft model; the verifier is built from the same weights
DEFAULT_EXTRA_LAYERS = 2
# The residual's size is measured on this text (its per-position RMS at the last layer,
# median over positions but the first, whose activations are the model's outliers).
RMS_TEXT = ("The quick brown fox jumps over the lazy dog. Water boils at one hundred degrees "
            "Celsius at sea level, and a week has seven days.")

Weights = dict[str, mx.array]


class PairModelError(ValueError):
    """A pair verifier that cannot be built as asked (the message says why)."""


# ---------------------------------------------------------------------------------------------
# pure transformations: (weights, config) -> (weights, config)

def _layer_count(config: dict) -> int:
    return int(config["num_hidden_layers"])


def pad_mlp(weights: Weights, config: dict, width: int) -> tuple[Weights, dict]:
    """Every MLP's intermediate size zero-padded to `width`: gate/up get rows of zeros, down
    columns of zeros, so silu(0) * 0 = 0 adds nothing. The same function."""
    base = int(config["intermediate_size"])
    if width < base:
        raise PairModelError(f"width {width} is below the model's MLP width {base}")
    out = dict(weights)
    pad = width - base
    for i in range(_layer_count(config)):
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj"):
            w = out[p + name + ".weight"]
            out[p + name + ".weight"] = mx.concatenate(
                [w, mx.zeros((pad, w.shape[1]), dtype=w.dtype)], axis=0) if pad else w
        w = out[p + "down_proj.weight"]
        out[p + "down_proj.weight"] = mx.concatenate(
            [w, mx.zeros((w.shape[0], pad), dtype=w.dtype)], axis=1) if pad else w
    return out, {**config, "intermediate_size": int(width)}


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def random_layer(config: dict, seed: int, index: int, out_scale: float) -> Weights:
    """One decoder layer's weights (relative names), numpy-seeded so the same on every machine:
    normal with std 1/sqrt(fan_in) (each projection keeps its input's RMS), unit norms, and
    the output projections (o_proj, down_proj) times `out_scale`."""
    rng = np.random.default_rng([seed, index])
    d, f, hd = int(config["hidden_size"]), int(config["intermediate_size"]), _head_dim(config)
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])

    def lin(rows: int, cols: int, scale: float = 1.0) -> mx.array:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale / cols**0.5)
        return mx.array(w)

    return {
        "self_attn.q_proj.weight": lin(heads * hd, d),
        "self_attn.k_proj.weight": lin(kv * hd, d),
        "self_attn.v_proj.weight": lin(kv * hd, d),
        "self_attn.o_proj.weight": lin(d, heads * hd, out_scale),
        "mlp.gate_proj.weight": lin(f, d),
        "mlp.up_proj.weight": lin(f, d),
        "mlp.down_proj.weight": lin(d, f, out_scale),
        "input_layernorm.weight": mx.ones((d,)),
        "post_attention_layernorm.weight": mx.ones((d,)),
    }


def append_layers(weights: Weights, config: dict, extra: int, eps: float, seed: int,
                  residual: float) -> tuple[Weights, dict]:
    """`extra` random layers after the last one, their output projections scaled by
    eps * residual (the residual stream's typical RMS there). eps = 0: exact identities.
    Apply before `pad_mlp` (the layers are built at the config's MLP width, then padded)."""
    if extra < 0 or eps < 0 or not np.isfinite(eps):
        raise PairModelError(f"extra layers ({extra}) and eps ({eps}) must be >= 0")
    out = dict(weights)
    n = _layer_count(config)
    for j in range(extra):
        for k, v in random_layer(config, seed, j, eps * residual).items():
            out[f"model.layers.{n + j}.{k}"] = v
    cfg = {**config, "num_hidden_layers": n + extra}
    if cfg.get("layer_types"):
        cfg["layer_types"] = list(cfg["layer_types"]) + [cfg["layer_types"][-1]] * extra
    return out, cfg


def noisy_weights(weights: Weights, noise: float, seed: int) -> Weights:
    """Every matrix (ndim >= 2: projections and the embedding) plus seeded gaussian noise of
    `noise` times its own RMS; norms and biases kept. noise = 0: the same weights."""
    if noise < 0 or not np.isfinite(noise):
        raise PairModelError(f"draft noise ({noise}) must be >= 0")
    if noise == 0:
        return dict(weights)
    rng = np.random.default_rng(seed)
    out: Weights = {}
    for name in sorted(weights):  # a fixed order: the same seed, the same noise
        w = weights[name]
        if w.ndim < 2:
            out[name] = w
            continue
        w32 = np.array(w.astype(mx.float32))
        rms = float(np.sqrt(np.mean(w32 * w32)))
        z = rng.standard_normal(w32.shape, dtype=np.float32)
        out[name] = mx.array(w32 + noise * rms * z).astype(w.dtype)
    return out


def model_from(weights: Weights, config: dict) -> nn.Module:
    """An mlx-lm llama built from a weight dict and config (in memory, nothing written)."""
    args = llama.ModelArgs.from_dict(config)
    model = llama.Model(args)
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())
    model.eval()
    return model


def weights_and_config(model: nn.Module) -> tuple[Weights, dict]:
    config = {k: v for k, v in asdict(model.args).items() if v is not None}
    return dict(tree_flatten(model.parameters())), config


def residual_rms(model: nn.Module, ids: Sequence[int]) -> float:
    """The residual stream's typical RMS after the last layer (before the final norm): median
    over positions (the first left out) of each position's RMS."""
    h = model.model.embed_tokens(mx.array([list(ids)]))
    for layer in model.model.layers:
        h = layer(h, "causal" if len(ids) > 1 else None, None)
    rms = mx.sqrt(mx.mean(h[0, 1:] * h[0, 1:], axis=-1))
    return float(np.median(np.array(rms)))


def pair_weights(model: nn.Module, ids: Sequence[int], width: int, extra_layers: int,
                 eps: float, seed: int) -> tuple[Weights, dict]:
    """The verifier's weights and config from a base model: extra layers, then padding."""
    w, cfg = weights_and_config(model)
    r = residual_rms(model, ids) if extra_layers and eps else 0.0
    w, cfg = append_layers(w, cfg, extra_layers, eps, seed, r)
    return pad_mlp(w, cfg, width)


# ---------------------------------------------------------------------------------------------
# the cached directory

def cache_key(width: int, extra_layers: int = 0, eps: float = 0.0, seed: int = 0) -> str:
    """The directory name of one verifier: every parameter and the format version."""
    return f"w{int(width)}-x{int(extra_layers)}-eps{float(eps)!r}-s{int(seed)}-f{FORMAT_VERSION}"


def pair_dir(width: int, extra_layers: int = 0, eps: float = 0.0, seed: int = 0) -> Path:
    return cache_root() / "pair" / cache_key(width, extra_layers, eps, seed)


def draft_cache_key(noise: float, seed: int = 0) -> str:
    return f"draft-n{float(noise)!r}-s{int(seed)}-f{FORMAT_VERSION}"


def draft_dir(noise: float, seed: int = 0) -> Path:
    return cache_root() / "pair" / draft_cache_key(noise, seed)


def write_model_dir(weights: Weights, config: dict, tokenizer, out: Path, source: str) -> Path:
    """config.json, model.safetensors and the tokenizer's files, written to a temporary
    directory beside `out` and renamed into place: `out` is whole or absent."""
    hf = getattr(tokenizer, "_tokenizer", None)
    if hf is None or not hasattr(hf, "save_pretrained"):
        raise PairModelError("the base model has no Hugging Face tokenizer to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        mx.save_safetensors(str(tmp / "model.safetensors"), weights,
                            metadata={"format": "mlx", "source": source})
        hf.save_pretrained(str(tmp))
        if out.exists():  # built meanwhile by another process, or stale: replace it
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_pair_verifier(width: int, extra_layers: int = 0, eps: float = 0.0, seed: int = 0,
                        out: Path | None = None, *, rebuild: bool = False) -> Path:
    """The wide (and, with extra layers, perturbed) SmolLM2 verifier as an mlx-lm directory:
    `out`, else macfleet's cache dir (`pair_dir`); built when absent (or `rebuild`)."""
    from macfleet.engine.models import load_model
    from macfleet.engine.text import encode_prompt

    path = out or pair_dir(width, extra_layers, eps, seed)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file() \
            and not rebuild:
        return path
    lm = load_model(DRAFT_SPEC)
    ids = encode_prompt(lm.tokenizer, RMS_TEXT, chat=False)
    w, cfg = pair_weights(lm.model, ids, width, extra_layers, eps, seed)
    src = f"{lm.source} (pair verifier {cache_key(width, extra_layers, eps, seed)})"
    return write_model_dir(w, cfg, lm.tokenizer, path, src)


def build_pair_draft(noise: float, seed: int = 0, out: Path | None = None, *,
                     rebuild: bool = False) -> str:
    """The draft model's spec for the draft dial: SmolLM2 itself at noise 0, else the noisy
    SmolLM2 (`noisy_weights`) as an mlx-lm directory, built when absent (or `rebuild`)."""
    from macfleet.engine.models import load_model

    if noise == 0 and out is None:
        return DRAFT_SPEC
    path = out or draft_dir(noise, seed)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file() \
            and not rebuild:
        return str(path)
    lm = load_model(DRAFT_SPEC)
    w, cfg = weights_and_config(lm.model)
    src = f"{lm.source} (pair draft {draft_cache_key(noise, seed)})"
    return str(write_model_dir(noisy_weights(w, noise, seed), cfg, lm.tokenizer, path, src))


def remove_pair_verifiers(keep: Sequence[Path] = ()) -> list[Path]:
    """Delete the cached verifiers (a wide one is gigabytes) but those in `keep`."""
    root = cache_root() / "pair"
    kept = {Path(k).resolve() for k in keep}
    gone = [p for p in sorted(root.glob("*")) if p.is_dir() and p.resolve() not in kept]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def param_bytes(config: dict, bytes_per_weight: int = 4) -> int:
    """Bytes one decode token reads (every weight once; a tied embedding once, as the head)."""
    d, f, n = (int(config[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    hd, heads = _head_dim(config), int(config["num_attention_heads"])
    kv, vocab = int(config["num_key_value_heads"]), int(config["vocab_size"])
    layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * f + 2 * d
    head = vocab * d * (1 if config.get("tie_word_embeddings", True) else 2)
    return (n * layer + head + d) * bytes_per_weight


def width_for_bytes(config: dict, target_bytes: float, extra_layers: int = 0) -> int:
    """The MLP width (a multiple of 256) whose verifier reads about `target_bytes` a token."""
    cfg = {**config, "num_hidden_layers": int(config["num_hidden_layers"]) + extra_layers}
    lo = param_bytes({**cfg, "intermediate_size": 0})
    per_unit = param_bytes({**cfg, "intermediate_size": 1}) - lo
    return max(int(config["intermediate_size"]),
               int(round((target_bytes - lo) / per_unit / 256)) * 256)
