"""An experiment, not part of the product. A/B: does fusing low/mid verifier layers (EAGLE-3) into the shipped head's input help?

Both variants warm-start from the shipped head and train the same steps on the same batches;
the tap variant adds tap_proj (zero-initialised: at step 0 it drafts exactly what the shipped
head does) over RMS-normed outputs of verifier layers TAPS, added to the normed last-layer
feature at the first draft step only (later steps are fed the head's own prediction).

Run (CPU or a lent GPU with MLX's CUDA build; DS: a dataset directory with tokens, e.g.
results/distill-smollm2-7.6M.tar.xz extracted; its hidden states are recomputed here with the
tap layers): DS=DIR POSITIONS=150000 STEPS=300 LR=1e-4 VARIANTS=tapsonly,taps,base
python .ci/gpu/taps_ab.py OUTDIR. Result: OUTDIR/result.json (results/eagle3_taps_ab.json).
"""
import hashlib
import json
import os
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

from macfleet.distill.heads import draft_argmax
from macfleet.distill.pipeline import HELD_OUT_SHARE
from macfleet.engine.proposers.eagle.head import EagleHead, load_head
from macfleet.engine.proposers.shipped import default_head_path
from macfleet.distill.train import draft_remap, _step_losses, lr_at, TrainParams
from macfleet.engine.layers import run_layers
from macfleet.engine.models import load_model

DS = os.environ.get("DS", "/tmp/exp/ds")
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/exp/run"
TAPS = tuple(int(x) for x in os.environ.get("TAPS", "2,15").split(","))
POSITIONS = int(os.environ.get("POSITIONS", "250000"))
STEPS = int(os.environ.get("STEPS", "300"))
LR = float(os.environ.get("LR", "3e-4"))
BATCH, SEQ = 8, 128
VARIANTS = os.environ.get("VARIANTS", "base,taps").split(",")
os.makedirs(OUT, exist_ok=True)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


lm = load_model("smollm2")
model = lm.model
H = model.args.hidden_size


def multi_features(ids: mx.array):
    h = model.model.embed_tokens(ids)
    mask = create_attention_mask(h, None)
    taps = []
    for i, layer in enumerate(model.model.layers):
        h = layer(h, mask, cache=None)
        if i in TAPS:
            taps.append(h)
    return taps, h


# -- training data: whole samples of groups the distill split would not hold out ------------
def held(group: str) -> bool:
    """distill.split_held_out's rule for a grouped sample (its groups stay unseen here too)."""
    every = max(2, int(round(1 / HELD_OUT_SHARE)))
    return bool(group) and int(hashlib.sha1(group.encode()).hexdigest()[:8], 16) % every \
        == every // 2


def load_samples():
    m = json.load(open(f"{DS}/manifest.json"))
    out = []
    for s in m["shards"]:
        name = s["name"]
        toks = np.load(f"{DS}/{name}.tokens.npy")
        top = np.load(f"{DS}/{name}.top.npy")
        offs = np.load(f"{DS}/{name}.offsets.npy")
        rows = [json.loads(x) for x in open(f"{DS}/{name}.meta.jsonl")]
        for (a, b), r in zip(zip(offs[:-1], offs[1:]), rows):
            if not held(r.get("group", "")) and 16 <= b - a <= 512:
                out.append((toks[a:b], top[a:b]))
    return out


def extract(samples, budget):
    rng = np.random.default_rng(0)
    order = rng.permutation(len(samples))
    chosen, n = [], 0
    for i in order:
        chosen.append(samples[i])
        n += len(samples[i][0])
        if n >= budget:
            break
    chosen.sort(key=lambda s: len(s[0]))
    out = []
    t0, done = time.time(), 0
    for i in range(0, len(chosen), 8):
        grp = chosen[i:i + 8]
        L = max(len(t) for t, _ in grp)
        ids = np.zeros((len(grp), L), np.int32)
        for j, (t, _) in enumerate(grp):
            ids[j, :len(t)] = t
        taps, last = multi_features(mx.array(ids))
        arrs = [x.astype(mx.float16) for x in taps + [last]]
        mx.eval(arrs)
        arrs = [np.array(x) for x in arrs]
        for j, (t, y) in enumerate(grp):
            n = len(t)
            out.append((t, y, arrs[-1][j, :n], np.stack([a[j, :n] for a in arrs[:-1]])))
            done += n
        if (i // 8) % 20 == 0:
            log(f"features {done}/{budget} positions, {done / (time.time() - t0):.0f} tok/s")
    return out


class TapHead(EagleHead):
    def __init__(self, config, verifier, ntaps):
        super().__init__(config, verifier)
        self.tap_norms = [nn.RMSNorm(H, eps=config.rms_norm_eps) for _ in range(ntaps)]
        self.tap_proj = nn.Linear(ntaps * H, H, bias=False)
        self.tap_proj.weight = mx.zeros_like(self.tap_proj.weight)

    def __call__(self, feats, next_tokens, cache=None, taps=None):
        g = self.in_norm(feats)
        if taps is not None:
            g = g + self.tap_proj(mx.concatenate([n(t) for n, t in zip(self.tap_norms, taps)],
                                                 axis=-1))
        x = self.fuse(mx.concatenate([g, self.embed(next_tokens)], axis=-1))
        return run_layers(self.layers, x, cache)


def make_head(kind):
    path = default_head_path("smollm2")
    base = load_head(path, model)
    if kind == "base":
        base.train()
        return base
    if kind == "tapsonly":
        head = make_head("taps")
        head.freeze()
        head.tap_proj.unfreeze()
        for n in head.tap_norms:
            n.unfreeze()
        return head
    head = TapHead(base.config, model, len(TAPS))
    head.train()
    head.load_weights(list(tree_flatten(base.parameters())), strict=False)
    head.set_draft_vocab(np.array(base.draft_ids))
    mx.eval(head.parameters())
    return head


def sample_batch(data, rng):
    lens = np.array([len(d[0]) for d in data], np.float64)
    f, t, y, tp = [], [], [], []
    for i in rng.choice(len(data), size=BATCH, p=lens / lens.sum()):
        tok, top, hid, taps = data[i]
        s = min(SEQ, len(tok))
        o = int(rng.integers(0, len(tok) - s + 1))
        pad = SEQ - s
        f.append(np.pad(hid[o:o + s], ((0, pad), (0, 0))))
        tp.append(np.pad(taps[:, o:o + s], ((0, 0), (0, pad), (0, 0))))
        t.append(np.pad(tok[o:o + s], (0, pad)))
        y.append(np.pad(top[o:o + s], (0, pad), constant_values=-1))
    tp = np.stack(tp, 1)  # [T, B, S, H]
    return (mx.array(np.stack(f)).astype(mx.float32), mx.array(np.stack(t)),
            mx.array(np.stack(y)), [mx.array(x).astype(mx.float32) for x in tp])


def loss_fn(head, feats, tokens, top, taps, scale, remap, use_taps, p):
    x = feats[:, :-1] + p.noise * scale * mx.random.normal(feats[:, :-1].shape)
    kw = {"taps": [t[:, :-1] for t in taps]} if use_taps else {}
    h = head(x, tokens[:, 1:].astype(mx.uint32), **kw)
    reg, ce = _step_losses(head, h, feats[:, 1:], top[:, 1:], scale, remap, p.target)
    loss = p.reg_weight * reg + p.ce_weight * ce
    for j in range(2, 2 + p.unroll_steps):
        h = head(h[:, :-1], tokens[:, j:].astype(mx.uint32))
        rj, cj = _step_losses(head, h, feats[:, j:], top[:, j:], scale, remap, p.target)
        loss = loss + p.unroll_weight * (p.reg_weight * rj + p.ce_weight * cj)
    return loss


def train(head, data, use_taps):
    p = TrainParams(steps=STEPS, batch=BATCH, seq_len=SEQ, lr=LR, ce_weight=0.5,
                    unroll_steps=3, unroll_weight=0.5)
    opt = optim.AdamW(learning_rate=lambda s: mx.array(lr_at(p, int(s), STEPS)),
                      weight_decay=p.weight_decay)
    remap = draft_remap(head)
    scale = head.config.feature_scale
    fn = nn.value_and_grad(head, lambda h, f, t, y, tp: loss_fn(h, f, t, y, tp, scale, remap,
                                                                use_taps, p))
    rng = np.random.default_rng(1)
    mx.random.seed(1)
    t0 = time.time()
    for step in range(1, STEPS + 1):
        f, t, y, tp = sample_batch(data, rng)
        loss, g = fn(head, f, t, y, tp)
        opt.update(head, g)
        mx.eval(head.parameters(), opt.state, loss)
        if step % 20 == 0:
            log(f"step {step}/{STEPS} loss {float(loss):.4f} "
                f"{step * BATCH * SEQ / (time.time() - t0):.0f} tok/s")
    head.eval()


def held_out_chunks():
    from macfleet.bench.drafter import HELD_OUT, CODE_KINDS
    from macfleet.distill.batchgen import generate_samples
    from macfleet.distill.prompts import Prompt, UNSEEN, prompt_text
    prompts = {**HELD_OUT, **UNSEEN}
    samples = list(generate_samples(lm, [Prompt.of("held_out", t) for t in prompts.values()],
                                    batch=8, max_answer=160))
    by = {s.prompt.text: s for s in samples}
    out = []
    for k, text in prompts.items():
        s = by[prompt_text(text)]
        taps, last = multi_features(mx.array(np.asarray(s.tokens, np.int32))[None])
        a = s.n_prompt - 1
        kind = "code" if k in CODE_KINDS or k.startswith("code:") else "chat"
        out.append((kind, np.asarray(s.tokens[a:]), np.asarray(s.top[a:]),
                    mx.array(last[0, a:]), [mx.array(x[0, a:]) for x in taps]))
    return out


def chain(head, chunks, use_taps, k=4):
    res = {"chat": [], "code": []}
    top1 = []
    for kind, tok, top, feats, taps in chunks:
        follows = tok[1:] == top[:-1]
        for t in range(1, len(tok) - k):
            if not follows[t:t + k].all():
                continue
            cache = head.make_cache()
            kw = {"taps": [x[None, :t] for x in taps]} if use_taps else {}
            h = head(feats[None, :t], mx.array(tok[1:t + 1], dtype=mx.uint32)[None],
                     cache=cache, **kw)[:, -1:]
            n = 0
            for j in range(k):
                d = draft_argmax(head, h[0, -1])
                if j == 0:
                    top1.append(d == int(top[t]))
                if d != int(tok[t + 1 + j]):
                    break
                n += 1
                if j + 1 < k:
                    h = head(h, mx.array([[d]], dtype=mx.uint32), cache=cache)
            res[kind].append(n)
    allv = res["chat"] + res["code"]
    return {"chat": float(np.mean(res["chat"])), "code": float(np.mean(res["code"])),
            "all": float(np.mean(allv)), "starts": len(allv), "top1": float(np.mean(top1))}


if __name__ == "__main__":
    log("held-out answers")
    ev = held_out_chunks()
    log("samples")
    data = extract(load_samples(), POSITIONS)
    log(f"{len(data)} samples, {sum(len(d[0]) for d in data)} positions")
    results = {"taps": TAPS, "positions": POSITIONS, "steps": STEPS, "lr": LR,
               "batch": BATCH, "seq": SEQ}
    h0 = make_head("base")
    results["shipped"] = chain(h0, ev, False)
    log("shipped", results["shipped"])
    for kind in VARIANTS:
        head = make_head(kind)
        if kind != "base":
            results[kind + "@0"] = chain(head, ev, True)
            log(kind + "@0", results[kind + "@0"])
        train(head, data, kind != "base")
        results[kind] = chain(head, ev, kind != "base")
        log(kind, results[kind])
        json.dump(results, open(f"{OUT}/result.json", "w"), indent=1)
    log("done", results)
