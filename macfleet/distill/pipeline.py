"""The `macfleet distill` pipeline: data -> verifier features -> trained head -> acceptance.

Work files (generated answers, extracted features, the resumable checkpoint) live in a work
directory (default `~/.cache/macfleet/distill/<verifier fingerprint>/`), never next to the
shipped weights, so `--resume` skips generation and extraction and continues training.
"""

from __future__ import annotations

import hashlib
import json

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from macfleet.distill import data
from macfleet.distill.heads import (FeatureChunk, config_for_verifier, deepened,
                                    extract_features, init_from_verifier, save_head)
from macfleet.distill.train import (Acceptance, TrainParams, chain_acceptance, choose_draft_vocab,
                                    feature_rms, train)
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers.eagle.head import (EagleHead, eval_path, load_head, read_eval,
                                                  verifier_fingerprint)

log = logging.getLogger(__name__)

DEFAULT_GEN_PROMPTS = 12
DEFAULT_GEN_TOKENS = 96
DEFAULT_TEXT_TOKENS = 24_000
DEFAULT_DRAFT_VOCAB = 8192
HELD_OUT_PROMPTS = 2  # the last generated answers are held out for the acceptance figure


@dataclass(frozen=True)
class DistillResult:
    path: Path
    steps: int
    train_tokens: int
    held_out: Acceptance
    untrained: Acceptance
    first_loss: float
    last_loss: float


def default_work_dir(lm: LoadedModel) -> Path:
    return Path.home() / ".cache" / "macfleet" / "distill" / verifier_fingerprint(lm.model)


def _save_features(path: Path, chunks: Sequence[FeatureChunk]) -> None:
    np.savez(path, **{f"{i}_{k}": getattr(c, k) for i, c in enumerate(chunks)
                      for k in ("tokens", "hidden", "top")},
             generated=np.array([c.generated for c in chunks]))


def _load_features(path: Path) -> list[FeatureChunk]:
    z = np.load(path)
    gen = z["generated"]
    return [FeatureChunk(z[f"{i}_tokens"], z[f"{i}_hidden"], z[f"{i}_top"], bool(gen[i]))
            for i in range(len(gen))]


def build_dataset(lm: LoadedModel, work: Path, paths: Sequence[str], gen_prompts: int,
                  gen_tokens: int, text_tokens: int, resume: bool,
                  report: Callable[[str], None]) -> tuple[list[FeatureChunk], list[FeatureChunk]]:
    """(train, held_out) feature chunks, cached in `work` (reused by --resume)."""
    fp = work / "features.npz"
    if resume and fp.is_file():
        report(f"reusing features from {fp}")
        chunks = _load_features(fp)
    else:
        prompts = [data.PROMPTS[i % len(data.PROMPTS)] for i in range(gen_prompts)]
        done = [0]

        def gen_progress(n: int) -> None:
            done[0] += n
            if done[0] % 50 == 0:
                report(f"generating answers: {done[0]}/{len(prompts) * gen_tokens} tokens")

        answers = data.cached_answers(lm, work / "answers.json", prompts, gen_tokens,
                                      gen_progress) if gen_prompts else []
        texts = data.read_texts(paths) if paths else data.default_local_texts(
            max(data.DEFAULT_FILE_CHARS, 6 * text_tokens))
        seqs: list[tuple[list[int], bool]] = []
        total = 0
        for t in texts:
            ids = list(lm.tokenizer.encode(t))
            seqs.append((ids[: max(0, text_tokens - total)], False))
            total += len(seqs[-1][0])
            if total >= text_tokens:
                break
        report(f"extracting features: {len(answers)} generated answers, {total} tokens of text")
        held = [(a, True) for a in answers[len(answers) - HELD_OUT_PROMPTS:]] if len(
            answers) > HELD_OUT_PROMPTS else []
        train_gen = [(a, True) for a in answers[: len(answers) - len(held)]]
        held_chunks = extract_features(lm.model, held)
        chunks = extract_features(lm.model, train_gen + seqs) + held_chunks
        n_held = len(held_chunks)
        work.mkdir(parents=True, exist_ok=True)
        _save_features(fp, chunks)
        (work / "held_out.txt").write_text(str(n_held))
    n_held = int((work / "held_out.txt").read_text()) if (work / "held_out.txt").is_file() else 0
    if n_held == 0 or n_held >= len(chunks):
        n_held = max(1, len(chunks) // 10)
    return chunks[:-n_held], chunks[-n_held:]


def write_eval(head_path, acc: Acceptance, before: Acceptance, steps: int, ntok: int,
               trained_on: dict | None = None) -> Path:
    """The held-out figure next to the weights: what the head is worth, measured by distill,
    and what it was trained on."""
    out = eval_path(head_path)
    doc = {"held_out": acc.to_dict(), "untrained": before.to_dict(), "steps": steps,
           "train_tokens": ntok}
    if trained_on:
        doc["trained_on"] = trained_on
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def distill(lm: LoadedModel, out: Path, params: TrainParams, *, paths: Sequence[str] = (),
            resume: bool = False, work: Path | None = None,
            gen_prompts: int = DEFAULT_GEN_PROMPTS, gen_tokens: int = DEFAULT_GEN_TOKENS,
            text_tokens: int = DEFAULT_TEXT_TOKENS, dtype: str = "float16",
            draft_vocab: int = DEFAULT_DRAFT_VOCAB, layers: int = 1,
            report: Callable[[str], None] = log.info) -> DistillResult:
    work = work or default_work_dir(lm)
    train_chunks, held = build_dataset(lm, work, paths, gen_prompts, gen_tokens, text_tokens,
                                       resume, report)
    ntok = sum(len(c.tokens) for c in train_chunks)
    cfg = config_for_verifier(lm.model, lm.spec, feature_scale=feature_rms(train_chunks),
                              dtype=dtype, layers=layers)
    mx.random.seed(params.seed)
    head = EagleHead(cfg, lm.model)
    mx.eval(head.parameters())
    if 0 < draft_vocab < cfg.vocab_size:  # chosen first: training targets this vocabulary
        head.set_draft_vocab(choose_draft_vocab(train_chunks, draft_vocab, cfg.vocab_size),
                               "frequency")
    before = chain_acceptance(head, held, max_starts=100)
    report(f"training on {ntok} tokens ({len(train_chunks)} chunks), held out "
           f"{sum(len(c.tokens) for c in held)} tokens; untrained acceptance "
           f"{before.mean_accepted:.2f}/4")
    losses = train(head, train_chunks, params, ckpt=work / "checkpoint", resume=resume,
                   report=report)
    acc = chain_acceptance(head, held, max_starts=200)
    path = save_head(head, out, steps=params.steps)
    write_eval(path, acc, before, params.steps, ntok)
    report(f"held-out greedy chain acceptance (k=4): per position "
           f"{', '.join(f'{x:.2f}' for x in acc.per_position)}; mean accepted "
           f"{acc.mean_accepted:.2f}; first-token agreement {acc.top1:.2f} over {acc.starts} "
           f"starts -> wrote {path}")
    return DistillResult(path=path, steps=params.steps, train_tokens=ntok, held_out=acc,
                         untrained=before, first_loss=losses[0] if losses else float("nan"),
                         last_loss=losses[-1] if losses else float("nan"))


HELD_OUT_SHARE = 0.02  # of the dataset's samples, for the held-out acceptance figure
CURVE_FILE = "curve.jsonl"  # held-out acceptance at every checkpoint of a dataset run


def read_curve(path: Path) -> list[dict]:
    """The learning curve of a dataset run (it travels in the head's eval record, so the plot
    of tau against training tokens can be redrawn wherever the head goes)."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def cumulative_curve(head_eval: dict | None) -> list[dict]:
    """A head's whole learning curve, training tokens counted from its first run (pure): a
    warm-started run records its own points from zero and its init's curve as `prior_curve`,
    so the plot of tau against training tokens goes on across runs and machines."""
    t = (head_eval or {}).get("trained_on") or {}
    prior = list(t.get("prior_curve") or [])
    done = prior[-1]["train_tokens"] if prior else 0
    return prior + [{**c, "train_tokens": done + c["train_tokens"]}
                    for c in t.get("curve") or []]


def split_held_out(chunks: Sequence[FeatureChunk], share: float = HELD_OUT_SHARE
                   ) -> tuple[list[FeatureChunk], list[FeatureChunk]]:
    """Hold out a `share` of the prompt groups (a topic, a code task, a problem template, a
    file: all their samples), chosen by a hash of the group so the split is stable as the
    dataset grows. Holding out single samples let the head be scored on answers to prompts
    made from the material it trained on (0.93 tokens per block of 4 there, 0.75 on prompts
    no template made). Chunks without a group are held out one in 1/share."""
    every = max(2, int(round(1 / share)))

    def held(i: int, c: FeatureChunk) -> bool:
        if not c.group:
            return i % every == every // 2
        return int(hashlib.sha1(c.group.encode()).hexdigest()[:8], 16) % every == every // 2

    flags = [held(i, c) for i, c in enumerate(chunks)]
    if not any(flags) or all(flags):  # too few groups to hold whole ones out
        flags = [i % every == every // 2 for i in range(len(chunks))]
    return ([c for c, f in zip(chunks, flags) if not f],
            [c for c, f in zip(chunks, flags) if f])


def distill_from_dataset(lm: LoadedModel, dataset: Path, out: Path, params: TrainParams, *,
                         work: Path, resume: bool = False,
                         draft_vocab: int = DEFAULT_DRAFT_VOCAB, dtype: str = "float16",
                         init_layer: bool = True, follow: bool = False,
                         held_out_share: float = HELD_OUT_SHARE,
                         init_head: Path | None = None, skip_missing: bool = False,
                         layers: int | None = None,
                         report: Callable[[str], None] = log.info,
                         progress: Callable[[int, int], None] | None = None) -> DistillResult:
    """Train a head on a dataset directory (memory-mapped; the verifier never runs again).
    init_layer: start the head's layer from the verifier's last layer; follow: re-read the
    dataset at every checkpoint (train while `distill --stage data` is still adding to it;
    the held-out answers stay those of the first read); init_head: go on training this head
    (its feature scale kept, its draft vocabulary re-chosen from this dataset at the same
    size; steps add up); skip_missing: train on the shards that have hidden states only;
    layers: decoder layers of the head (default: the init head's, or 1; a deeper one than
    init_head grows from it, see heads.py `deepened`)."""
    from macfleet.distill.dataset import Manifest, check_verifier, load_chunks

    m = Manifest.read(dataset)
    check_verifier(m, dataset, lm, verifier_fingerprint(lm.model))
    train_chunks, held = split_held_out(load_chunks(dataset, skip_missing=skip_missing),
                                        held_out_share)
    ntok = sum(len(c.tokens) for c in train_chunks)
    mx.random.seed(params.seed)
    prior_steps, prior_curve = 0, []
    if init_head is not None:
        head = load_head(init_head, lm.model)
        prior_steps = head.config.steps
        prior_curve = cumulative_curve(read_eval(init_head))
        report(f"going on from {init_head} ({prior_steps} steps)")
        if head.draft_ids is not None:
            # the draft vocabulary follows the data: the weights do not depend on it (drafts
            # are the head's features against the verifier's own embedding rows), and one
            # chosen on an early, smaller dataset leaves common tokens out (the shipped
            # head's, chosen on 1M answer tokens, covered 93.0% of 7.6M; re-chosen, 97.2%)
            size = int(head.draft_ids.size)
            head.set_draft_vocab(choose_draft_vocab(train_chunks, size, head.config.vocab_size),
                                   "frequency")
            report(f"draft vocabulary re-chosen from this dataset ({size} ids)")
        if layers is not None and layers != len(head.layers):
            head = deepened(head, layers)
            report(f"deepened to {layers} decoder layers (the added ones start as the identity)")
    else:
        cfg = config_for_verifier(lm.model, lm.spec, feature_scale=feature_rms(train_chunks),
                                  dtype=dtype, layers=layers or 1)
        head = EagleHead(cfg, lm.model)
        if init_layer and not init_from_verifier(head):
            report("the verifier's last layer cannot seed the head (quantized?): random init")
        mx.eval(head.parameters())
        if 0 < draft_vocab < cfg.vocab_size:
            head.set_draft_vocab(choose_draft_vocab(train_chunks, draft_vocab, cfg.vocab_size),
                               "frequency")
    before = chain_acceptance(head, held, max_starts=100)
    report(f"training on {ntok:,} positions ({len(train_chunks)} answers, {m.answer_tokens:,} "
           f"answer tokens in the dataset), held out {len(held)} answers")
    curve = work / CURVE_FILE

    reached = [params.steps]  # the last step: fewer than params.steps under a time limit

    def measure(step: int) -> None:
        """A point of the learning curve: held-out acceptance against training tokens."""
        reached[0] = step
        a = chain_acceptance(head, held, max_starts=150)
        with open(curve, "a") as f:
            f.write(json.dumps({"step": step, "train_tokens": step * params.batch
                                * params.seq_len, "dataset_answer_tokens": m.answer_tokens,
                                "dataset_positions": m.tokens, "mean_accepted": a.mean_accepted,
                                "per_position": a.per_position, "top1": a.top1}) + "\n")
        report(f"held out at step {step}: mean accepted {a.mean_accepted:.2f}/4, per position "
               f"{', '.join(f'{x:.2f}' for x in a.per_position)}")

    work.mkdir(parents=True, exist_ok=True)
    if not resume:
        curve.unlink(missing_ok=True)
    def reread() -> list[FeatureChunk]:
        nonlocal m
        m = Manifest.read(dataset)
        return split_held_out(load_chunks(dataset, skip_missing=skip_missing),
                              held_out_share)[0]

    losses = train(head, train_chunks, params, ckpt=work / "checkpoint-ds", resume=resume,
                   report=report, on_checkpoint=measure, refresh=reread if follow else None,
                   progress=progress)
    acc = chain_acceptance(head, held, max_starts=300)
    steps = reached[0]
    path = save_head(head, out, steps=prior_steps + steps)
    write_eval(path, acc, before, steps, ntok,
               {"processed_tokens": steps * params.batch * params.seq_len,
                "dataset": str(dataset), "verifier": m.verifier, "answers": m.samples,
                "answer_tokens": m.answer_tokens, "positions": m.tokens,
                "held_out_answers": len(held), "params": asdict(params),
                "init": (f"{init_head} ({prior_steps} steps)" if init_head is not None
                         else "verifier_last_layer" if init_layer else "random"),
                "prompt_sources": "the verifier's own questions, chat requests, topics, code, "
                                  "local text, word problems (macfleet/distill/"
                                  "prompts.py, self_instruct.py)",
                "curve": read_curve(curve), "prior_curve": prior_curve})
    report(f"held-out greedy chain acceptance (k=4): per position "
           f"{', '.join(f'{x:.2f}' for x in acc.per_position)}; mean accepted "
           f"{acc.mean_accepted:.2f} -> wrote {path}")
    return DistillResult(path=path, steps=steps, train_tokens=ntok, held_out=acc,
                         untrained=before, first_loss=losses[0] if losses else float("nan"),
                         last_loss=losses[-1] if losses else float("nan"))
