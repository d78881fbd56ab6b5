"""Training the EAGLE head (self-distillation from the verifier), and its acceptance figure.

Loss on each pair (f_t, x_{t+1}) -> f^_{t+1}:
  w_reg * smooth-L1((f^_{t+1} - f_{t+1}) / scale)  next-feature regression (EAGLE)
+ w_ce * CE(LMhead(norm(f^_{t+1})), target)        the verifier's next token: its greedy token
                                                   (target "hard"), or its whole distribution
                                                   (target "soft": LMhead(norm(f_{t+1})), read
                                                   off the stored feature, so it costs no
                                                   verifier run and no extra storage)
Features get small Gaussian noise at the input (EAGLE's trick against its own errors when the
chain feeds predicted features back). AdamW, cosine decay, resumable checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from macfleet.distill.heads import FeatureChunk, draft_argmax, same_record
from macfleet.engine.proposers.eagle.head import EagleHead

log = logging.getLogger(__name__)

DEFAULT_K = 4


@dataclass(frozen=True)
class TrainParams:
    steps: int = 400
    batch: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    ce_weight: float = 0.1
    noise: float = 0.05  # input-feature noise, in units of the feature RMS
    unroll_weight: float = 0.5  # loss of each later step fed the head's own predicted features
    unroll_steps: int = 1  # later steps (EAGLE-3's training-time test): 1 = two steps in all
    gen_fraction: float = 0.5  # share of each batch drawn from the verifier's own answers
    target: str = "hard"  # token loss against the verifier's greedy token or its distribution
    reg_weight: float = 1.0  # weight of the feature regression
    time_limit: float = 0.0  # seconds: stop by then, the schedule fitted to the steps that fit
    save_every: int = 50
    seed: int = 0


@dataclass(frozen=True)
class Acceptance:
    """Greedy chain acceptance of k drafted tokens against the verifier's greedy tokens."""

    k: int
    starts: int
    per_position: tuple[float, ...]  # P(draft token j accepted), j = 1..k (chain: all before it)
    mean_accepted: float  # mean accepted tokens per block of k
    top1: float  # teacher-forced: head's first token == verifier's greedy token

    def to_dict(self) -> dict:
        return asdict(self)


def feature_rms(chunks: Sequence[FeatureChunk]) -> float:
    sample = np.concatenate([c.hidden[:64].astype(np.float32) for c in chunks[:64]])
    return float(np.sqrt(np.mean(sample ** 2)))


def sample_batch(chunks: Sequence[FeatureChunk], p: TrainParams,
                 rng: np.random.Generator) -> tuple[mx.array, mx.array, mx.array]:
    """Random windows: feats [B, S, H] float32, tokens [B, S], top [B, S]."""
    f, t, y = [], [], []
    lens = np.array([len(c.tokens) for c in chunks], dtype=np.float64)
    gen = np.array([bool(getattr(c, "generated", False)) for c in chunks])
    # The verifier's own answers are what the head must predict at run time: give them a
    # fixed share of every batch however much file text there is.
    if 0 < p.gen_fraction < 1 and gen.any() and (~gen).any():
        w = np.where(gen, p.gen_fraction / lens[gen].sum(), (1 - p.gen_fraction) / lens[~gen].sum())
        probs = lens * w
    else:
        probs = lens
    for i in rng.choice(len(chunks), size=p.batch, p=probs / probs.sum()):
        c = chunks[i]
        s = min(p.seq_len, len(c.tokens))
        o = int(rng.integers(0, len(c.tokens) - s + 1))
        pad = p.seq_len - s
        f.append(np.pad(c.hidden[o : o + s], ((0, pad), (0, 0))))  # float16: cast on device
        t.append(np.pad(c.tokens[o : o + s], (0, pad)))
        y.append(np.pad(c.top[o : o + s], (0, pad), constant_values=-1))
    return (mx.array(np.stack(f)).astype(mx.float32), mx.array(np.stack(t)),
            mx.array(np.stack(y)))


def draft_remap(head: EagleHead) -> mx.array | None:
    """token id -> index in the head's draft vocabulary (-1 outside it), or None (full)."""
    ids = head.draft_ids
    if ids is None:
        return None
    remap = np.full(head.config.vocab_size, -1, dtype=np.int32)
    remap[np.array(ids)] = np.arange(ids.size, dtype=np.int32)
    return mx.array(remap)


TARGETS = ("hard", "soft")


def _step_losses(head: EagleHead, h: mx.array, feats: mx.array, top: mx.array,
                 scale: float, remap: mx.array | None = None,
                 target: str = "hard") -> tuple[mx.array, mx.array]:
    """h [B, L, H] predicts feats [B, L, H] and the verifier's next token: its greedy token
    top [B, L] (target "hard"; -1 marks padding), or its distribution read off feats through
    the frozen LM head (target "soft": cross-entropy to it, KL up to a constant -- every
    position teaches the ranking of all candidates, which is what a token tree drafts from).

    With a draft vocabulary (remap), the token loss is over that vocabulary only -- what the
    head drafts from -- which also makes the LM head ~6x cheaper to train."""
    valid = (top >= 0).astype(mx.float32)
    n = mx.maximum(valid.sum(), 1.0)
    reg = nn.losses.smooth_l1_loss((h - feats) / scale, mx.zeros_like(h),
                                   reduction="none").mean(-1)
    if target == "soft":
        teacher = mx.stop_gradient(head.draft_logits(feats).astype(mx.float32))
        student = head.draft_logits(h).astype(mx.float32)
        ce = -(mx.softmax(teacher, axis=-1) * nn.log_softmax(student, axis=-1)).sum(-1)
        return (reg * valid).sum() / n, (ce * valid).sum() / n
    if remap is None:
        logits, tgt, ce_valid = head.logits(h), mx.maximum(top, 0), valid
    else:
        tgt = remap[mx.maximum(top, 0)]
        ce_valid = valid * (tgt >= 0).astype(mx.float32)
        logits, tgt = head.draft_logits(h), mx.maximum(tgt, 0)
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), tgt, reduction="none")
    return (reg * valid).sum() / n, (ce * ce_valid).sum() / mx.maximum(ce_valid.sum(), 1.0)


def loss_fn(head: EagleHead, feats: mx.array, tokens: mx.array, top: mx.array,
            scale: float, ce_weight: float, noise: float,
            unroll_weight: float = 0.0, remap: mx.array | None = None,
            unroll_steps: int = 1, target: str = "hard",
            reg_weight: float = 1.0) -> tuple[mx.array, mx.array]:
    """Step 1 on real features; then `unroll_steps` steps each fed the head's own predictions
    of the step before (the chain the proposer runs: draft j+1 reads draft j's feature)."""
    x = feats[:, :-1]
    if noise > 0:
        x = x + noise * scale * mx.random.normal(x.shape)
    h = head(x, tokens[:, 1:].astype(mx.uint32))
    reg, ce = _step_losses(head, h, feats[:, 1:], top[:, 1:], scale, remap, target)
    loss = reg_weight * reg + ce_weight * ce
    if unroll_weight > 0:
        for j in range(2, 2 + unroll_steps):
            if feats.shape[1] <= j:
                break
            h = head(h[:, :-1], tokens[:, j:].astype(mx.uint32))
            reg_j, ce_j = _step_losses(head, h, feats[:, j:], top[:, j:], scale, remap, target)
            loss = loss + unroll_weight * (reg_weight * reg_j + ce_weight * ce_j)
    return loss, mx.stack([reg, ce])


def _ckpt_paths(ckpt: Path) -> tuple[Path, Path, Path]:
    return ckpt / "head.safetensors", ckpt / "optimizer.safetensors", ckpt / "state.json"


def save_checkpoint(ckpt: Path, head: EagleHead, opt: optim.Optimizer, step: int) -> None:
    hp, op, sp = _ckpt_paths(ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(hp), dict(tree_flatten(head.parameters())))
    mx.save_safetensors(str(op), {k: v for k, v in tree_flatten(opt.state)
                                  if isinstance(v, mx.array)})
    sp.write_text(json.dumps({"step": step, "config": asdict(head.config)}))


def load_checkpoint(ckpt: Path, head: EagleHead, opt: optim.Optimizer) -> int:
    """Restore head and optimizer; returns the step reached (0 when there is none)."""
    hp, op, sp = _ckpt_paths(ckpt)
    if not sp.is_file():
        return 0
    state = json.loads(sp.read_text())
    saved = state["config"]
    if not same_record((saved["fingerprint"], tuple(saved.get("probe", ()))),
                       (head.config.fingerprint, head.config.probe)):
        raise ValueError(f"checkpoint {ckpt} was made for another verifier")
    head.load_weights(list(mx.load(str(hp)).items()), strict=True)
    opt.state = tree_unflatten(list(mx.load(str(op)).items()))
    return int(state["step"])


class Horizon:
    """The step a run ends at, which its learning-rate schedule decays to: p.steps, or fewer
    when a time limit is measured to allow fewer (`fit`)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def fit(self, step: int, seconds_per_step: float, seconds_left: float,
            most: int) -> int:
        """Steps that fit in seconds_left from step (pure arithmetic; never past most, never
        before the next step)."""
        fits = step + int(max(seconds_left, 0.0) / max(seconds_per_step, 1e-9))
        self.steps = max(step + 1, min(most, fits))
        return self.steps


def lr_at(p: TrainParams, step: float, horizon: int) -> float:
    """Linear warm-up over the first tenth (at most 20 steps), then cosine decay to 5% of the
    peak at `horizon` (pure)."""
    warm = max(1, min(20, horizon // 10))
    lo = p.lr * 0.05
    if step < warm:
        return lo + (p.lr - lo) * step / warm
    frac = min(1.0, (step - warm) / max(1, horizon - warm))
    return lo + (p.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))


def make_optimizer(p: TrainParams, horizon: Horizon | None = None) -> optim.Optimizer:
    h = horizon or Horizon(p.steps)
    return optim.AdamW(learning_rate=lambda step: mx.array(lr_at(p, int(step), h.steps)),
                       weight_decay=p.weight_decay)


def train(head: EagleHead, chunks: Sequence[FeatureChunk], p: TrainParams,
          ckpt: Path | None = None, resume: bool = False,
          report: Callable[[str], None] | None = None,
          on_checkpoint: Callable[[int], None] | None = None,
          refresh: Callable[[], Sequence[FeatureChunk]] | None = None,
          progress: Callable[[int, int], None] | None = None) -> list[float]:
    """Train in place; returns the loss per step run. Checkpoints every p.save_every steps
    (then calls on_checkpoint(step): the held-out curve is measured there, and refresh():
    training data that grows while it trains -- a dataset still being generated).
    progress(step, steps) after every step (steps moves when --time-limit refits it)."""
    if not chunks:
        raise ValueError("no training data")
    if p.target not in TARGETS:
        raise ValueError(f"target {p.target!r}: one of {', '.join(TARGETS)}")
    scale = head.config.feature_scale
    horizon = Horizon(p.steps)
    opt = make_optimizer(p, horizon)
    step = load_checkpoint(ckpt, head, opt) if (ckpt is not None and resume) else 0
    rng = np.random.default_rng([p.seed, step])
    mx.random.seed(p.seed + step)
    remap = draft_remap(head)
    step_fn = nn.value_and_grad(head, lambda h, f, t, y: loss_fn(h, f, t, y, scale,
                                                                   p.ce_weight, p.noise,
                                                                   p.unroll_weight, remap,
                                                                   p.unroll_steps, p.target,
                                                                   p.reg_weight))
    losses: list[float] = []
    t0 = time.perf_counter()
    start = step
    timed_from: tuple[int, float] | None = None  # (step, time) once past the first slow steps
    while step < horizon.steps:
        f, t, y = sample_batch(chunks, p, rng)
        (loss, parts), grads = step_fn(head, f, t, y)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss, parts)
        step += 1
        losses.append(float(loss))
        now = time.perf_counter()
        if p.time_limit > 0 and step - start == 5:
            timed_from = (step, now)
        if timed_from is not None and (step - timed_from[0]) % 10 == 0 and step > timed_from[0]:
            # the checkpoints' own time counts as training time here: it recurs
            horizon.fit(step, (now - timed_from[1]) / (step - timed_from[0]),
                        t0 + p.time_limit - now, p.steps)
        if progress is not None:
            progress(step, horizon.steps)
        if report is not None and (step % 10 == 0 or step == horizon.steps):
            rate = (now - t0) / (step - start)
            reg, ce = (float(v) for v in parts)
            report(f"step {step}/{horizon.steps} loss {losses[-1]:.4f} (feature {reg:.4f}, ce "
                   f"{ce:.3f}) {rate:.2f} s/step, {p.batch * p.seq_len / rate:,.0f} tokens/s, "
                   f"eta {rate * (horizon.steps - step) / 60:.1f} min")
        if step % p.save_every == 0 or step == horizon.steps:
            if ckpt is not None:
                save_checkpoint(ckpt, head, opt, step)
            if on_checkpoint is not None:
                on_checkpoint(step)
            if refresh is not None:
                chunks = refresh() or chunks
    return losses


def chain_acceptance(head: EagleHead, chunks: Sequence[FeatureChunk], k: int = DEFAULT_K,
                     max_starts: int = 200, seed: int = 0) -> Acceptance:
    """Greedy chain acceptance on held-out chunks.

    At start t the head has seen the real pairs up to t-1 (as in the proposer), drafts k tokens,
    and is scored against the verifier's greedy chain. The chain is known exactly where the text
    itself follows the verifier's greedy path for the next k tokens (x_{t+j} == top_{t+j-1}):
    the verifier's own generated answers, and such stretches of other text.
    """
    rng = np.random.default_rng(seed)
    cands = []
    for ci, c in enumerate(chunks):
        follows = c.tokens[1:] == c.top[:-1]  # x_{t+1} is the verifier's greedy token
        for t in range(1, len(c.tokens) - k):
            if follows[t : t + k].all():
                cands.append((ci, t))
    if len(cands) > max_starts:
        cands = [cands[i] for i in sorted(rng.choice(len(cands), max_starts, replace=False))]
    hits = np.zeros(k)
    top1_hits = 0
    by_chunk: dict[int, list[int]] = {}
    for ci, t in cands:
        by_chunk.setdefault(ci, []).append(t)
    accepted_total = 0
    for ci, starts in by_chunk.items():
        c = chunks[ci]
        feats = mx.array(c.hidden.astype(np.float32))
        for t in starts:
            cache = head.make_cache()
            h = head(feats[None, :t], mx.array(c.tokens[1 : t + 1], dtype=mx.uint32)[None],
                     cache=cache)[:, -1:]
            n_ok = 0
            for j in range(k):
                tok = draft_argmax(head, h[0, -1])
                if j == 0:
                    top1_hits += tok == int(c.top[t])
                if tok != int(c.tokens[t + 1 + j]):
                    break
                n_ok += 1
                if j + 1 < k:
                    h = head(h, mx.array([[tok]], dtype=mx.uint32), cache=cache)
            hits[:n_ok] += 1
            accepted_total += n_ok
    n = max(len(cands), 1)
    return Acceptance(k, len(cands), tuple(float(x) for x in hits / n),
                      accepted_total / n, top1_hits / n)


def untrained_loss(head: EagleHead, chunks: Sequence[FeatureChunk], p: TrainParams,
                   batches: int = 4) -> float:
    rng = np.random.default_rng(12345)
    tot = 0.0
    for _ in range(batches):
        f, t, y = sample_batch(chunks, p, rng)
        loss, _ = loss_fn(head, f, t, y, head.config.feature_scale, p.ce_weight, 0.0,
                          target=p.target, reg_weight=p.reg_weight)
        tot += float(loss)
    return tot / batches




def choose_draft_vocab(chunks: Sequence[FeatureChunk], size: int, vocab: int) -> np.ndarray:
    """The `size` ids drafts may use, most frequent first (so any prefix is the best draft
    vocabulary of its size: `EagleHead.draft_logits(h, limit)`): tokens seen in the data by
    count, then the lowest unseen ids (byte-level BPE numbers merges by frequency, so low ids
    are common tokens). Save with draft order "frequency"."""
    if size <= 0 or size >= vocab:
        return np.arange(vocab, dtype=np.int32)
    counts = np.bincount(np.concatenate([np.concatenate([c.tokens, c.top]) for c in chunks]),
                         minlength=vocab)
    return frequency_order(counts, size)


def frequency_order(counts: np.ndarray, size: int, among: np.ndarray | None = None
                    ) -> np.ndarray:
    """`size` token ids by descending count (ties: lower id first), seen ones only, then the
    lowest unseen ids; among: choose from these ids only (re-order an existing draft
    vocabulary). Pure."""
    pool = np.arange(len(counts)) if among is None else np.asarray(among, dtype=np.int64)
    c = counts[pool]
    order = np.lexsort((pool, -c))  # by count descending, then id
    seen = pool[order][c[order] > 0][:size]
    rest = np.setdiff1d(pool, seen)[: size - len(seen)]  # sorted ascending
    return np.concatenate([seen, rest]).astype(np.int32)
