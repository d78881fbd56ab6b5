"""`macfleet distill`: train an EAGLE-style draft head for a verifier (offline)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from macfleet.cli.common import UserError

# answer lengths: distill/batchgen.py DEFAULT_MAX_ANSWER, distill/pipeline.py DEFAULT_GEN_TOKENS
# (those modules import MLX; the help is built without it)
DEFAULT_MAX_ANSWER = 256
DEFAULT_GEN_TOKENS = 96


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="train an EAGLE draft head for a verifier (offline)")
    p.add_argument("--model", default="smollm2", help="verifier spec (default: %(default)s)")
    p.add_argument("--data", nargs="*", default=[], metavar="PATH",
                   help="text files or directories (.txt .md .py .rst); default: docstrings and "
                   "docs installed on this machine, plus the verifier's own answers")
    p.add_argument("--out", default=None, help="output PATH[.safetensors] (+ .json); default: "
                   "./<model>-eagle.safetensors")
    p.add_argument("--steps", type=int, default=400, help="training steps")
    p.add_argument("--batch", type=int, default=4, help="training sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--ce-weight", type=float, default=0.5,
                   help="weight of the next-token loss against the feature regression")
    p.add_argument("--unroll", type=int, default=1, metavar="N",
                   help="training steps fed the head's own predicted features after the first "
                   "(the chain a proposer runs; more helps later draft positions)")
    p.add_argument("--target", choices=("hard", "soft"), default="hard",
                   help="token loss against the verifier's greedy token (hard) or its whole "
                        "next-token distribution, read off the stored hidden states (soft)")
    p.add_argument("--reg-weight", type=float, default=1.0,
                   help="weight of the next-feature regression (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=0.0, metavar="S",
                   help="train for at most S seconds: the steps that fit (at most --steps) are "
                        "measured as it runs and the learning rate decays to them")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="decoder layers of the head (default: --init HEAD's, or 1); more than "
                        "the init head's grow it, the added layers starting as the identity")
    p.add_argument("--gen-prompts", type=int, default=12,
                   help="built-in prompts the verifier answers itself (slow: ~10 tok/s on CPU)")
    p.add_argument("--text-tokens", type=int, default=24000,
                   help="tokens of file text to extract features for")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="token ids drafts may use (0: the whole vocabulary); the LM head is most "
                   "of the draft cost")
    p.add_argument("--work", default=None, metavar="DIR", help="work directory (answers, "
                   "features, checkpoint; default: ~/.cache/macfleet/distill/<the "
                   "verifier's fingerprint>)")
    p.add_argument("--dataset", default=None, metavar="DIR",
                   help="distillation dataset directory (the verifier's answers + hidden "
                   "states, memory-mapped); default: <work>/dataset")
    p.add_argument("--tokens", type=int, default=0, metavar="N",
                   help="generate the verifier's own answers in batches until the dataset "
                   "holds N answer tokens (resumable), then train on it")
    p.add_argument("--gen-batch", type=int, default=32, help="rows per generation forward")
    p.add_argument("--gen-mode", choices=("continuous", "waves"), default="continuous",
                   help="continuous: finished rows are refilled between steps (a CPU); waves: "
                   "fixed waves prefilled in one forward and decoded to the end (a GPU, where a "
                   "step costs about the same at any batch)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per generated answer "
                   f"(default: {DEFAULT_MAX_ANSWER} with --tokens, {DEFAULT_GEN_TOKENS} for "
                   "the --gen-prompts answers)")
    p.add_argument("--questions", type=int, default=0, metavar="N",
                   help="first have the verifier write lists of questions for N seed requests "
                   "(sampled, parsed, deduplicated; ~5-9 kept per seed) into "
                   "<dataset>/questions.jsonl; the data stage answers them among its sources "
                   "(resumable). When the listed subjects' seeds run out, the verifier names "
                   "subtopics of them (<dataset>/subtopics.jsonl) and is asked about those")
    p.add_argument("--subtopic-depth", type=int, default=None, metavar="D",
                   help="how deep subtopics may go below a listed subject (default: 3; 0: the "
                   "listed subjects only)")
    p.add_argument("--features-batch", type=int, default=4096, metavar="TOKENS",
                   help="padded tokens per forward when rebuilding hidden states (an "
                   "accelerator takes ~65536)")
    p.add_argument("--stage", choices=("all", "questions", "data", "features", "train", "store"),
                   default="all",
                   help="questions: only write questions (--questions N); data: only generate; "
                   "features: only rebuild missing hidden states "
                   "(a dataset copied without them); train: only train on the dataset "
                   "(rebuilding missing hidden states first); store: only write the answer "
                   "store")
    p.add_argument("--init", default="verifier", metavar="verifier|random|HEAD",
                   help="start the head's layer from the verifier's last layer (default), "
                   "from random weights, or go on training a head (PATH[.safetensors])")
    p.add_argument("--skip-missing-hidden", action="store_true",
                   help="train on the shards that have hidden states; do not rebuild the others")
    p.add_argument("--follow", action="store_true",
                   help="train while another `distill --stage data` adds to the dataset: "
                   "re-read it at every checkpoint")
    p.add_argument("--store", default=None, metavar="PATH.npy",
                   help="also add the dataset's answers to a retrieval store (the "
                   "`retrieval:PATH` drafter; default: none)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.set_defaults(func=run)


def _stop_on_term(signum, frame) -> None:
    raise KeyboardInterrupt  # `kill` stops a long run like Ctrl-C: the open shard is written


def run(args) -> int:
    from macfleet.distill.pipeline import distill
    from macfleet.distill.train import TrainParams
    from macfleet.cli.common import load_model
    from macfleet.engine.models import ModelSpecError

    if args.steps < 1 or args.batch < 1 or args.seq_len < 8 or args.unroll < 0:
        raise UserError("--steps and --batch must be >= 1, --seq-len >= 8, --unroll >= 0")
    if (args.layers is not None and args.layers < 1) or args.reg_weight < 0 \
            or args.time_limit < 0:
        raise UserError("--layers must be >= 1, --reg-weight and --time-limit >= 0")
    if args.questions < 0 or args.features_batch < 1 or args.gen_batch < 1 \
            or (args.subtopic_depth is not None and args.subtopic_depth < 0):
        raise UserError("--questions and --subtopic-depth must be >= 0, --features-batch and "
                        "--gen-batch >= 1")
    if args.stage == "questions" and args.questions < 1:
        raise UserError("--stage questions needs --questions N (seed requests to ask)")
    signal.signal(signal.SIGTERM, _stop_on_term)
    for d in args.data:
        if not Path(d).expanduser().exists():
            raise UserError(f"--data: no such file or directory: {d}")
    try:
        lm = load_model(args.model)
    except ModelSpecError as e:
        raise UserError(str(e)) from None
    out = Path(args.out or f"{args.model.replace(':', '-').replace('/', '-')}-eagle")
    params = TrainParams(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                         save_every=args.save_every, ce_weight=args.ce_weight,
                         unroll_steps=args.unroll, target=args.target,
                         reg_weight=args.reg_weight, time_limit=args.time_limit)
    if args.tokens > 0 or args.questions > 0 or args.stage != "all":
        return _run_dataset(args, lm, out, params)
    if args.init not in ("verifier", "random") or args.skip_missing_hidden:
        raise UserError("--init HEAD and --skip-missing-hidden train from a dataset: add "
                        "--dataset DIR --stage train")
    try:
        distill(lm, out, params, paths=args.data, resume=args.resume,
                work=Path(args.work) if args.work else None, gen_prompts=args.gen_prompts,
                gen_tokens=args.max_tokens or DEFAULT_GEN_TOKENS, text_tokens=args.text_tokens,
                draft_vocab=args.draft_vocab, layers=args.layers or 1,
                report=lambda s: print(s, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    return 0


def _steps(b):
    """train()'s progress(step, steps) onto a bar; a resumed run starts counting where it
    resumed, so its rate and ETA are this run's."""
    def update(step: int, steps: int) -> None:
        if b.done == 0 and step > 1:
            b.rebase(step - 1)
        b.update(step, total=steps)
    return update


def _run_dataset(args, lm, out: Path, params) -> int:
    """The scaled pipeline: batched self-distillation data on disk, then training from it."""
    from macfleet import progress
    from macfleet.distill.dataset import (DatasetError, generate_dataset,
                                          missing_hidden, rebuild_hidden)
    from macfleet.distill.pipeline import default_work_dir, distill_from_dataset
    from macfleet.engine.proposers.eagle.head import verifier_fingerprint, weights_path

    work = Path(args.work) if args.work else default_work_dir(lm)
    ds = Path(args.dataset) if args.dataset else work / "dataset"
    report = (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        if args.stage in ("all", "questions", "data") and args.questions > 0:
            from macfleet.distill.self_instruct import MAX_DEPTH, generate_questions

            depth = MAX_DEPTH if args.subtopic_depth is None else args.subtopic_depth
            with progress.bar("questions", args.questions, unit="seeds") as b:
                a = generate_questions(lm, ds, args.questions, batch=args.gen_batch,
                                       max_depth=depth, report=b.log,
                                       progress=lambda done, want: b.update(done, total=want))
            report(f"questions {ds}: {a.seeds} seed requests asked, {a.questions} questions "
                   f"kept ({a.total} in all), {a.subjects} subtopics named, in "
                   f"{a.seconds:.0f} s")
        if args.stage in ("all", "data") and args.tokens > 0:
            from macfleet.distill.batchgen import generate_samples, generate_waves

            gen = generate_waves if args.gen_mode == "waves" else generate_samples
            m = generate_dataset(lm, ds, args.tokens, fingerprint=verifier_fingerprint(lm.model),
                                 batch=args.gen_batch,
                                 max_answer=args.max_tokens or DEFAULT_MAX_ANSWER, generator=gen)
            report(f"dataset {ds}: {m.samples} answers, {m.answer_tokens:,} answer tokens, "
                   f"{m.tokens:,} positions with hidden states; {m.seconds / 60:.1f} min "
                   f"generating ({', '.join(f'{k} {v:.0f}' for k, v in m.timing.items())})")
        if args.store and args.stage in ("all", "data", "store"):
            from macfleet.distill.dataset import answers, merged_store, save_store
            from macfleet.engine.proposers.retrieval import Datastore

            sp = Path(args.store).with_suffix(".npy")
            old = Datastore.load(sp) if sp.is_file() else Datastore.build([])
            store = merged_store(old, answers(ds))
            report(f"answer store: {old.tokens.size:,} -> {store.tokens.size:,} tokens (answers "
                   f"already there kept, repeats dropped) -> {save_store(store, sp)}")
        init_head = None if args.init in ("verifier", "random") else Path(args.init)
        if init_head is not None and not weights_path(init_head).is_file():
            raise UserError(f"--init: no draft head at {weights_path(init_head)}")
        if (args.stage == "features" or (args.stage in ("all", "train")
                                         and not args.skip_missing_hidden)) and missing_hidden(ds):
            r = rebuild_hidden(lm, ds, fingerprint=verifier_fingerprint(lm.model),
                               batch_tokens=args.features_batch)
            report(f"rebuilt hidden states of {r.shards} shard(s): {r.tokens:,} positions in "
                   f"{r.seconds / 60:.1f} min ({r.tokens / max(r.seconds, 1e-9):.0f} tok/s); "
                   f"{r.top_mismatch} positions where this machine's argmax differs from "
                   f"the stored greedy token")
        if args.stage in ("all", "train"):
            with progress.bar("train", params.steps, unit="steps") as b:
                distill_from_dataset(lm, ds, out, params, work=work, resume=args.resume,
                                     draft_vocab=args.draft_vocab,
                                     init_layer=args.init == "verifier", follow=args.follow,
                                     init_head=init_head, skip_missing=args.skip_missing_hidden,
                                     layers=args.layers, report=b.log,
                                     progress=_steps(b))
    except (DatasetError, ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    return 0
