"""What training an EAGLE head needs of it beyond drafting (engine/proposers/eagle/head.py and
features.py draft; this makes and writes heads): the verifier's features as training chunks
(`extract_features`), a config for a verifier, a head started from the verifier's last layer or
deepened by identity layers, the greedy draft of one feature (chain acceptance), and a head's
save (docs/drafters.md, "eagle/head.py")."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from macfleet.engine.layers import head_logits
from macfleet.engine.proposers.eagle.features import hidden_states
from macfleet.engine.proposers.eagle.head import (DRAFT_VOCAB_KEY, EagleConfig, EagleHead,
                                                  config_path, same_verifier, verifier_fingerprint,
                                                  verifier_probe, weights_path)

DEFAULT_CHUNK = 256


@dataclass(frozen=True)
class FeatureChunk:
    """One chunk of text as the verifier sees it (numpy, so it stores and batches cheaply)."""

    tokens: np.ndarray  # [L] int32
    hidden: np.ndarray  # [L, H] float16: f_t
    top: np.ndarray  # [L] int32: the verifier's argmax after position t (its greedy next token)
    generated: bool = False  # text the verifier produced itself (greedy)
    group: str = ""  # the prompt's material (prompts.Prompt.group), for held-out splits


def extract_features(model: nn.Module, seqs: Iterable[tuple[Sequence[int], bool]],
                     chunk: int = DEFAULT_CHUNK) -> list[FeatureChunk]:
    """One verifier forward per chunk (no cache across chunks: each chunk is its own context)."""
    out: list[FeatureChunk] = []
    for ids, gen in seqs:
        for i in range(0, len(ids) - 1, chunk):
            piece = list(ids[i : i + chunk])
            if len(piece) < 8:
                continue
            h = hidden_states(model, mx.array(piece, dtype=mx.uint32)[None])
            top = mx.argmax(head_logits(model, h), axis=-1)
            mx.eval(h, top)
            out.append(FeatureChunk(np.array(piece, dtype=np.int32),
                                    np.array(h[0].astype(mx.float16)),
                                    np.array(top[0]).astype(np.int32), gen))
    return out


def same_record(a: tuple[str, Sequence[float]], b: tuple[str, Sequence[float]]) -> bool:
    """Pure: whether two recorded (fingerprint, probe) pairs name the same verifier."""
    return a[0] == b[0] or same_verifier(a[1], b[1])


def config_for_verifier(model: nn.Module, spec: str, **kw) -> EagleConfig:
    """A head's config for this verifier (its spec, fingerprint, probe and shapes)."""
    a = model.args
    return EagleConfig(verifier=spec, fingerprint=verifier_fingerprint(model),
                       probe=verifier_probe(model),
                       hidden_size=a.hidden_size, vocab_size=a.vocab_size,
                       verifier_layers=len(model.layers), num_heads=a.num_attention_heads,
                       num_kv_heads=a.num_key_value_heads, intermediate_size=a.intermediate_size,
                       rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
                       rope_traditional=bool(getattr(a, "rope_traditional", False)), **kw)


def init_from_verifier(head: EagleHead) -> bool:
    """Start the head's decoder layer from the verifier's last layer (it already reads these
    features); False when it cannot (quantized, or another architecture)."""
    return _from_last_layer(head, head.layers[0])


def _from_last_layer(head: EagleHead, layer: nn.Module) -> bool:
    theirs = dict(tree_flatten(head.verifier.model.layers[-1].parameters()))
    mine = dict(tree_flatten(layer.parameters()))
    if set(mine) != set(theirs) or any(mine[k].shape != theirs[k].shape for k in mine):
        return False
    layer.load_weights([(k, v.astype(mx.float32)) for k, v in theirs.items()])
    return True


def deepened(head: EagleHead, layers: int) -> EagleHead:
    """This head with `layers` decoder layers, each added one starting as the identity (its
    output projections zero), so it drafts what this one does until training moves it."""
    if layers < len(head.layers):
        raise ValueError(f"a head of {len(head.layers)} layers cannot shrink to {layers}")
    deep = EagleHead(replace(head.config, layers=layers), head.verifier)
    deep.load_weights(list(tree_flatten(head.parameters())), strict=False)
    for layer in deep.layers[len(head.layers):]:
        mine = dict(tree_flatten(layer.parameters()))
        _from_last_layer(deep, layer)
        layer.load_weights([(k, mx.zeros_like(mine[k])) for k in
                            ("self_attn.o_proj.weight", "mlp.down_proj.weight")],
                           strict=False)
    if head.draft_ids is not None:
        deep.set_draft_vocab(np.array(head.draft_ids), head.config.draft_order)
    mx.eval(deep.parameters())
    return deep


def draft_argmax(head: EagleHead, h: mx.array) -> int:
    """The head's greedy draft token for one predicted feature h [H]."""
    i = int(mx.argmax(head.draft_logits(h)).item())
    return i if head.draft_ids is None else int(head.draft_ids[i].item())


def save_head(head: EagleHead, path: str | Path, steps: int | None = None) -> Path:
    """Write PATH.safetensors (head weights in config.dtype) and PATH.json (config)."""
    p = weights_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    cfg = head.config if steps is None else replace(head.config, steps=steps)
    dt = getattr(mx, cfg.dtype)
    w = {k: v.astype(dt) for k, v in tree_flatten(head.parameters())}
    if head.draft_ids is not None:  # config.draft_vocab/draft_order describe these
        w[DRAFT_VOCAB_KEY] = head.draft_ids.astype(mx.int32)
    tmp = p.with_name(p.stem + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), w, metadata={"format": "macfleet-eagle",
                                               "version": str(cfg.version)})
    tmp.replace(p)
    config_path(p).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    head.config = cfg
    return p
