"""Verifiers for `bench overhead`: the project's model in a chosen dtype, and random-weight
llamas in the shape of the models users bring.

A random-weight llama of 1-8B costs what a real one costs per forward (the same matmuls over
the same bytes), so it measures the bandwidth-bound regime where a block of L tokens costs
about one token, without any real big model. Its answers are noise, which is fine: the oracle
drafts the run's own answer (bench/oracle.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama

from macfleet.engine import fastmath
from macfleet.engine.models import LoadedModel, load_model

# native: as the project loads it (dense on Linux, its own 4-bit on macOS); q: the model's own
# quantized format (the GGUF's 4-bit for smollm2); 4bit: the dense weights through nn.quantize
DTYPES = ("native", "float32", "bfloat16", "float16", "4bit", "q")
FLOAT_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
QUANT_GROUP, QUANT_BITS = 64, 4

# Llama 3.x shapes (1b, 3b: Llama-3.2; 8b: Llama-3.1) and a miniature for tests.
BIG_SHAPES: dict[str, dict] = {
    "mini": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
               num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=False),
}


def parse_dtypes(text: str) -> tuple[str, ...]:
    """'float32,bfloat16' -> ('float32', 'bfloat16'); ValueError naming the choices."""
    out = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in out if d not in DTYPES]
    if not out or bad:
        raise ValueError(f"dtype must be among {', '.join(DTYPES)} (comma-separated), "
                         f"got {text!r}")
    return out


def parse_shapes(text: str) -> tuple[str, ...]:
    """'1b,3b' -> ('1b', '3b'); '' or 'none' -> ()."""
    if text.strip() in ("", "none"):
        return ()
    out = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in out if s not in BIG_SHAPES]
    if bad:
        raise ValueError(f"big shape must be among {', '.join(BIG_SHAPES)}, got {bad}")
    return out


def big_args(shape: str) -> llama.ModelArgs:
    kw = {"tie_word_embeddings": True, **BIG_SHAPES[shape]}
    return llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                           max_position_embeddings=8192, **kw)


def param_count(args: llama.ModelArgs) -> int:
    """Parameters of a llama of these args (pure: the size printed beside a measurement)."""
    h, n, i = args.hidden_size, args.num_hidden_layers, args.intermediate_size
    hd = args.head_dim or h // args.num_attention_heads
    kv = (args.num_key_value_heads or args.num_attention_heads) * hd
    attn = h * args.num_attention_heads * hd * 2 + h * kv * 2
    layer = attn + 3 * h * i + 2 * h
    emb = args.vocab_size * h
    return emb * (1 if args.tie_word_embeddings else 2) + n * layer + h


def convert(model: nn.Module, dtype: str) -> nn.Module:
    """Cast the floating weights to `dtype` or quantize them (4bit), in place, layer by layer
    so a big model never holds two copies."""
    if dtype in FLOAT_DTYPES:
        model.set_dtype(FLOAT_DTYPES[dtype])
    elif dtype == "4bit":
        nn.quantize(model, group_size=QUANT_GROUP, bits=QUANT_BITS,
                    class_predicate=lambda _p, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % QUANT_GROUP == 0)
    elif dtype not in ("native", "q"):
        raise ValueError(f"unknown dtype {dtype!r}")
    for layer in getattr(getattr(model, "model", None), "layers", []):
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def weights_format(model: nn.Module) -> str:
    """What the weights are now: 'quantized' or the dtype of the first layer's q_proj."""
    q = model.model.layers[0].self_attn.q_proj
    return "quantized" if hasattr(q, "scales") else str(q.weight.dtype).replace("mlx.core.", "")


@dataclass(frozen=True)
class BenchModel:
    """A verifier to measure: its weights, the tokenizer when it has one, how it was made."""

    label: str  # e.g. "smollm2 bfloat16", "random llama 1b bfloat16"
    model: nn.Module
    lm: LoadedModel | None  # None: random weights, no tokenizer
    weights: str  # what the weights are now (weights_format)
    params: int


def project_model(spec: str, dtype: str) -> BenchModel:
    """The project's model `spec` in `dtype` (a fresh copy unless native: the process-wide
    cached one stays as loaded)."""
    if dtype == "native":
        lm = load_model(spec)
    else:
        lm = load_model(spec, dense=dtype != "q", cached=False)
        convert(lm.model, dtype)
    return BenchModel(f"{spec} {dtype}", lm.model, lm, weights_format(lm.model),
                      count_params(lm.model))


def count_params(model: nn.Module) -> int:
    """Parameters of `model` as its dense form has them (a quantized layer's packed weight
    counts 32 / bits values a word; its scales and biases do not count)."""
    n = 0
    for _, m in model.named_modules():
        own = {k: v for k, v in m.items() if isinstance(v, mx.array)}
        bits = getattr(m, "bits", None)
        if "scales" in own and bits:
            n += own["weight"].size * 32 // bits
            own = {k: v for k, v in own.items() if k not in ("weight", "scales", "biases")}
        n += sum(v.size for v in own.values())
    return n


RANDOM_POOL = (1 << 22) + 7  # not a multiple of any width: tiled rows never repeat exactly


def fill_random(model: nn.Module, dtype: str, seed: int = 0, tile: bool | None = None) -> None:
    """Give every weight of `model` values uniform in +-1/sqrt(fan_in) (norms: ones), layer by
    layer in `dtype` (4bit: quantized from bfloat16), never holding a float32 copy of the
    model. An accelerator draws them itself; a CPU tiles a random pool from a random offset
    per tensor (drawing billions of numbers costs it minutes; a forward costs the same).
    tile: force one way (default: tile on a CPU)."""
    rng = np.random.default_rng(seed)
    on_cpu = mx.default_device() == mx.cpu if tile is None else tile
    pool = rng.random(RANDOM_POOL, dtype=np.float32) * 2.0 - 1.0 if on_cpu else None
    fdt = FLOAT_DTYPES.get(dtype, mx.bfloat16 if dtype == "4bit" else mx.float32)
    key = mx.random.key(seed)

    def tensor(shape: tuple[int, ...]) -> mx.array:
        nonlocal key
        if len(shape) == 1:
            return mx.ones(shape, dtype=fdt)
        if not on_cpu:
            key, sub = mx.random.split(key)
            return mx.random.uniform(-1.0, 1.0, shape, dtype=fdt, key=sub) * \
                (1.0 / math.sqrt(shape[-1]))
        o = int(rng.integers(RANDOM_POOL))
        flat = np.resize(np.concatenate([pool[o:], pool[:o]]), int(np.prod(shape)))
        return (mx.array(flat.reshape(shape)) * (1.0 / math.sqrt(shape[-1]))).astype(fdt)

    def fill(module: nn.Module, skip: str | None = None) -> None:
        new = [(name, tensor(tuple(p.shape))) for name, p in
               tree_flatten(module.parameters()) if not (skip and name.startswith(skip))]
        module.update(tree_unflatten(new))
        if dtype == "4bit":
            convert(module, "4bit")
        mx.eval(module.parameters())

    for layer in model.model.layers:
        fill(layer)
    fill(model, skip="model.layers.")


def random_llama(shape: str, dtype: str, seed: int = 0) -> BenchModel:
    """A llama of `shape` with random weights in `dtype` (float32 when native)."""
    args = big_args(shape)
    model = llama.Model(args)  # its own initial weights stay lazy: never computed
    fill_random(model, "float32" if dtype in ("native", "q") else dtype, seed)
    model.eval()
    fastmath.install(model)
    return BenchModel(f"random llama {shape} {dtype}", model, None, weights_format(model),
                      param_count(args))
