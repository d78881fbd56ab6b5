"""The EAGLE-style draft head: one decoder layer predicting the verifier's next pre-norm hidden
state from (f_t, token t+1), read by the verifier's own frozen norm and LM head; saved alone,
with its verifier's fingerprint and probe (docs/drafters.md, "eagle/head.py")."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from macfleet.engine.layers import head_logits, run_layers

FORMAT_VERSION = 1
FEATURE_KIND = "prenorm_last_layer"
DEFAULT_DTYPE = "float16"
DRAFT_VOCAB_KEY = "draft_vocab_ids"
DRAFT_ORDERS = ("id", "frequency")
# same_verifier's tolerance: far above float last-bit noise between backends (~1e-7 relative),
# far below the differences of another checkpoint or seed (embedding values differ at ~1e-2)
PROBE_ATOL = 1e-3
PROBE_RTOL = 1e-3


class HeadMismatch(ValueError):
    """A draft head trained for another verifier (or a file that is not a head)."""


def verifier_fingerprint(model: nn.Module) -> str:
    """A short hash of a few embedding outputs and norm weights of the verifier (read through the
    modules, so a dense and a quantized load of one checkpoint agree)."""
    inner = model.model
    ids = mx.array([0, 1, 2, 3, model.args.vocab_size // 2, model.args.vocab_size - 1])
    parts = [inner.embed_tokens(ids)[:, :64], inner.norm.weight,
             *(layer.input_layernorm.weight[:32] for layer in inner.layers)]
    h = hashlib.sha256(f"{model.args.hidden_size}:{model.args.vocab_size}:"
                       f"{len(inner.layers)}".encode())
    for p in parts:
        h.update(np.round(np.array(p.astype(mx.float32)), 2).tobytes())
    return h.hexdigest()[:16]


def verifier_probe(model: nn.Module) -> tuple[float, ...]:
    """A few dozen of the verifier's values (embedding outputs, final and per-layer norm
    weights), compared within `same_verifier`'s tolerance: unlike the fingerprint, robust to
    another backend's last-bit differences."""
    inner = model.model
    ids = mx.array([0, 1, 2, 3, model.args.vocab_size // 2, model.args.vocab_size - 1])
    parts = [inner.embed_tokens(ids)[:, :4], inner.norm.weight[:8],
             *(layer.input_layernorm.weight[:1] for layer in inner.layers)]
    vals = np.concatenate([np.array(p.astype(mx.float32)).ravel() for p in parts])
    return tuple(float(f"{v:.6g}") for v in vals.tolist())  # 6 digits: short JSON, << tolerance


def same_verifier(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two probes come from the same checkpoint: same length, every value within
    PROBE_ATOL + PROBE_RTOL * |value|; empty probes and NaN never match."""
    if not a or len(a) != len(b):
        return False
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    tol = PROBE_ATOL + PROBE_RTOL * np.maximum(np.abs(x), np.abs(y))
    return bool(np.all(np.abs(x - y) <= tol))


def matches_verifier(fingerprint: str, probe: Sequence[float], model: nn.Module, *,
                     model_fingerprint: str | None = None) -> bool:
    """Whether a recorded (fingerprint, probe) identifies this verifier: the exact hash, or the
    probe within tolerance. model_fingerprint: this verifier's, when the caller has it."""
    fp = verifier_fingerprint(model) if model_fingerprint is None else model_fingerprint
    return fingerprint == fp or (bool(probe) and same_verifier(probe, verifier_probe(model)))


@dataclass(frozen=True)
class EagleConfig:
    verifier: str  # the verifier's model spec when trained
    fingerprint: str  # verifier_fingerprint() of that verifier
    hidden_size: int
    vocab_size: int
    verifier_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_traditional: bool
    feature: str = FEATURE_KIND
    feature_scale: float = 1.0  # RMS of the features: regression loss is measured in these units
    layers: int = 1
    draft_vocab: int = 0  # >0: drafts use only this many token ids (saved with the weights)
    # "frequency": the saved draft ids most frequent first (a prefix is the best draft vocabulary
    # of its size); "id": ascending
    draft_order: str = "id"
    dtype: str = DEFAULT_DTYPE
    steps: int = 0
    version: int = FORMAT_VERSION
    probe: tuple[float, ...] = ()  # verifier_probe() of that verifier; () in older configs

    def layer_args(self) -> llama.ModelArgs:
        return llama.ModelArgs(
            model_type="llama", hidden_size=self.hidden_size, num_hidden_layers=self.layers,
            intermediate_size=self.intermediate_size, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size, rope_theta=self.rope_theta,
            rope_traditional=self.rope_traditional, tie_word_embeddings=True)

    def check_verifier(self, model: nn.Module) -> None:
        fp = verifier_fingerprint(model)
        if not matches_verifier(self.fingerprint, self.probe, model, model_fingerprint=fp) \
                or model.args.hidden_size != self.hidden_size \
                or model.args.vocab_size != self.vocab_size:
            raise HeadMismatch(
                f"this draft head was trained for verifier '{self.verifier}' (fingerprint "
                f"{self.fingerprint}, hidden {self.hidden_size}, vocab {self.vocab_size}); the "
                f"verifier here has fingerprint {fp}, hidden {model.args.hidden_size}, vocab "
                f"{model.args.vocab_size}: train a head for it with `macfleet distill`")


class _Frozen:
    """Holds the verifier outside the module tree, so its weights are neither trained nor saved."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, verifier: nn.Module) -> None:
        super().__init__()
        config.check_verifier(verifier)
        if not config.probe:  # an older config, matched by its exact hash: saved with a probe
            config = replace(config, probe=verifier_probe(verifier))
        # the draft vocabulary's fields describe `_sub`, which set_draft_vocab keeps in step
        self.config = replace(config, draft_vocab=0, draft_order="id")
        self._v = _Frozen(verifier)
        h = config.hidden_size
        self.in_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.fuse = nn.Linear(2 * h, h, bias=True)
        args = config.layer_args()
        self.layers = [llama.TransformerBlock(args) for _ in range(config.layers)]
        self._sub = _Frozen(None)  # (ids [V'], rows [V', H]) of the draft vocabulary
        self._prefix: dict[int, mx.array] = {}  # n -> rows[:n], contiguous (draft_logits)

    def set_draft_vocab(self, ids: np.ndarray | None, order: str = "id") -> None:
        """Draft from a subset of the vocabulary (EAGLE-3's trick: the LM head is most of the
        draft cost); a quantized embedding keeps the full head. order: "frequency" when `ids`
        are most frequent first, so `draft_logits(h, limit)` may draft from a prefix."""
        if order not in DRAFT_ORDERS:
            raise ValueError(f"draft_order must be one of {DRAFT_ORDERS}, not {order!r}")
        emb = self.verifier.model.embed_tokens
        self._prefix = {}
        if ids is None or not len(ids) or not isinstance(emb, nn.Embedding) or \
                not getattr(self.verifier.args, "tie_word_embeddings", True):
            self._sub = _Frozen(None)
            self.config = replace(self.config, draft_vocab=0, draft_order="id")
            return
        idx = mx.array(np.asarray(ids, dtype=np.int32))
        rows = emb.weight[idx]
        mx.eval(idx, rows)  # now: MLX streams are per thread, and the head may draft on another
        self._sub = _Frozen((idx, rows))
        self.config = replace(self.config, draft_vocab=int(idx.size), draft_order=order)

    @property
    def draft_ids(self) -> mx.array | None:
        return None if self._sub.model is None else self._sub.model[0]

    def draft_logits(self, h: mx.array, limit: int = 0) -> mx.array:
        """Logits over the draft vocabulary (index into `draft_ids`), or the full one; limit >
        0, on a frequency-ordered draft vocabulary: over its first `limit` ids only."""
        if self._sub.model is None:
            return self.logits(h)
        rows = self._sub.model[1]
        if 0 < limit < rows.shape[0] and self.config.draft_order == "frequency":
            if limit not in self._prefix:
                prefix = mx.array(np.array(rows[:limit]))  # contiguous: read once per call
                mx.eval(prefix)
                self._prefix[limit] = prefix
            rows = self._prefix[limit]
        return self.verifier.model.norm(h) @ rows.T

    @property
    def verifier(self) -> nn.Module:
        return self._v.model

    def embed(self, tokens: mx.array) -> mx.array:
        return self.verifier.model.embed_tokens(tokens)

    def __call__(self, feats: mx.array, next_tokens: mx.array, cache=None) -> mx.array:
        """feats [B, L, H] (f_t), next_tokens [B, L] (x_{t+1}) -> predicted f_{t+1} [B, L, H]."""
        return run_layers(self.layers, self.inputs(feats, next_tokens), cache)

    def inputs(self, feats: mx.array, next_tokens: mx.array) -> mx.array:
        """The decoder layers' input for pairs (f_t, x_{t+1}): [B, L, H]."""
        return self.fuse(mx.concatenate([self.in_norm(feats), self.embed(next_tokens)],
                                        axis=-1))

    def logits(self, h: mx.array) -> mx.array:
        """The verifier's own final norm + LM head on (predicted) features."""
        return head_logits(self.verifier, h)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]


def weights_path(path: str | Path) -> Path:
    p = Path(path).expanduser()
    return p if p.suffix == ".safetensors" else p.with_suffix(".safetensors")


def config_path(path: str | Path) -> Path:
    return weights_path(path).with_suffix(".json")


def eval_path(head_path: str | Path) -> Path:
    """`<head>.eval.json` beside its weights: its held-out figures (`macfleet distill`)."""
    p = Path(head_path)
    return p.with_name(p.name.removesuffix(".safetensors") + ".eval.json")


def read_eval(head_path: str | Path) -> dict | None:
    """A head's `.eval.json`, or None when it has none (or an unreadable one)."""
    try:
        return json.loads(eval_path(head_path).read_text())
    except (OSError, ValueError):
        return None


def read_config(path: str | Path) -> EagleConfig:
    cp = config_path(path)
    if not cp.is_file():
        raise HeadMismatch(f"no draft-head config at {cp}")
    try:
        d = json.loads(cp.read_text())
        d["probe"] = tuple(float(v) for v in d.get("probe", ()))  # a JSON list
        cfg = EagleConfig(**d)
    except (ValueError, TypeError, AttributeError) as e:
        raise HeadMismatch(f"{cp} is not a macfleet draft-head config: {e}") from e
    if cfg.version != FORMAT_VERSION:
        raise HeadMismatch(f"{cp}: head format {cfg.version}, this macfleet reads "
                           f"{FORMAT_VERSION}")
    if cfg.draft_order not in DRAFT_ORDERS:
        raise HeadMismatch(f"{cp}: draft_order {cfg.draft_order!r} is not one of "
                           f"{DRAFT_ORDERS}")
    return cfg


def load_head(path: str | Path, verifier: nn.Module) -> EagleHead:
    """Load a head for this verifier; HeadMismatch when it was trained for another one."""
    cfg = read_config(path)
    head = EagleHead(cfg, verifier)  # checks the fingerprint
    wp = weights_path(path)
    if not wp.is_file():
        raise HeadMismatch(f"no draft-head weights at {wp}")
    w = mx.load(str(wp))
    ids = w.pop(DRAFT_VOCAB_KEY, None)
    head.load_weights([(k, v.astype(mx.float32)) for k, v in w.items()], strict=True)
    if ids is not None:
        head.set_draft_vocab(np.array(ids), cfg.draft_order)
    mx.eval(head.parameters())
    head.eval()
    return head
