"""A distillation dataset directory: the verifier's answers and its hidden states, on disk.

Layout (all numpy `.npy`, so training memory-maps them and never recomputes the verifier):

    manifest.json               verifier spec + fingerprint and probe, hidden size, shards,
                                totals, timing
    keys.txt                    one prompt key per line (deduplication and resume)
    shard-00000.tokens.npy      [N] int32     every fed token of every sample, concatenated
    shard-00000.hidden.npy      [N, H] float16 last-layer pre-norm hidden state per token
    shard-00000.top.npy         [N] int32     the verifier's greedy next token per position
    shard-00000.offsets.npy     [S+1] int64   sample boundaries
    shard-00000.nprompt.npy     [S] int32     prompt length of each sample
    shard-00000.meta.jsonl      source and finish reason of each sample

A shard is written whole (files, then the manifest, atomically); a run stopped mid-shard loses
at most one shard's worth of generation and resumes where the manifest says.

The hidden states are a cache, not the record: they are 97% of the bytes (1,152 bytes a token
for SmolLM2 against ~9 for the rest) but cost only a prefill to rebuild, while the answers cost
a decode each. A directory without its `*.hidden.npy` files (copied between machines, or kept
in git) is still a whole dataset: `rebuild_hidden` (`macfleet distill --stage features`, and
training on its own) recomputes them, one verifier forward per sample.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from macfleet.distill.batchgen import (DEFAULT_BATCH, DEFAULT_MAX_ANSWER, Sample, Timing,
                                       generate_samples)
from macfleet.distill.heads import FeatureChunk
from macfleet.distill.prompts import iter_prompts
from macfleet.engine.cachedir import write_atomic
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers.eagle.head import matches_verifier, verifier_probe
from macfleet.engine.proposers.retrieval import SEPARATOR, Datastore

MANIFEST = "manifest.json"
KEYS = "keys.txt"
DEFAULT_SHARD_TOKENS = 32_768
FORMAT = 1


class DatasetError(ValueError):
    """A dataset directory that is missing, damaged, or made by another verifier."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    tokens: int  # fed positions (rows of hidden)
    answer_tokens: int


@dataclass
class Manifest:
    verifier: str
    fingerprint: str
    hidden_size: int
    shards: list[ShardInfo] = field(default_factory=list)
    seconds: float = 0.0
    timing: dict[str, float] = field(default_factory=dict)
    format: int = FORMAT
    probe: tuple[float, ...] = ()  # verifier_probe(); () in manifests written before probes

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def answer_tokens(self) -> int:
        return sum(s.answer_tokens for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            d = json.loads((path / MANIFEST).read_text())
            d["shards"] = [ShardInfo(**s) for s in d.get("shards", [])]
            d["probe"] = tuple(float(v) for v in d.get("probe", ()))  # a JSON list
            m = cls(**d)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise DatasetError(f"{path}: not a distillation dataset ({e})") from e
        if m.format != FORMAT:
            raise DatasetError(f"{path}: dataset format {m.format}, this macfleet reads {FORMAT}")
        return m


def check_verifier(m: Manifest, path: Path, lm: LoadedModel, fingerprint: str) -> None:
    """Refuse a dataset of another verifier (`fingerprint`: this verifier's); the same
    checkpoint on another backend is accepted through the manifest's probe."""
    if not matches_verifier(m.fingerprint, m.probe, lm.model, model_fingerprint=fingerprint):
        raise DatasetError(f"{path} holds data of verifier '{m.verifier}' (fingerprint "
                           f"{m.fingerprint}); this verifier's is {fingerprint}")


def open_manifest(path: Path, lm: LoadedModel, fingerprint: str) -> Manifest:
    """The directory's manifest (checked against this verifier), or a new one. A manifest
    without a probe gets this verifier's (written with the next shard)."""
    if (path / MANIFEST).is_file():
        m = Manifest.read(path)
        check_verifier(m, path, lm, fingerprint)
        if not m.probe:
            m.probe = verifier_probe(lm.model)
        return m
    path.mkdir(parents=True, exist_ok=True)
    return Manifest(verifier=lm.spec, fingerprint=fingerprint, hidden_size=lm.hidden_size,
                    probe=verifier_probe(lm.model))


def write_shard(path: Path, index: int, samples: Sequence[Sample]) -> ShardInfo:
    name = f"shard-{index:05d}"
    offsets = np.cumsum([0] + [len(s.tokens) for s in samples]).astype(np.int64)
    arrays = {"tokens": np.concatenate([s.tokens for s in samples]).astype(np.int32),
              "hidden": np.concatenate([s.hidden for s in samples]).astype(np.float16),
              "top": np.concatenate([s.top for s in samples]).astype(np.int32),
              "offsets": offsets,
              "nprompt": np.array([s.n_prompt for s in samples], dtype=np.int32)}
    for k, a in arrays.items():
        np.save(path / f"{name}.{k}.npy", a)
    meta = "".join(json.dumps({"source": s.prompt.source, "finish": s.finish,
                               "key": s.prompt.key, "group": s.prompt.group}) + "\n"
                   for s in samples)
    (path / f"{name}.meta.jsonl").write_text(meta)
    return ShardInfo(name, len(samples), int(offsets[-1]),
                     sum(s.answer_tokens for s in samples))


def done_keys(path: Path) -> frozenset[str]:
    f = path / KEYS
    return frozenset(f.read_text().split()) if f.is_file() else frozenset()


class Progress:
    """Rate and ETA of a dataset stage: a rich bar on a terminal, else a plain line every 30 s
    (macfleet/progress.py); `report` takes the plain lines instead of stderr."""

    def __init__(self, target: int, start: int, report: Callable[[str], None] | None = None,
                 every_s: float = 30.0, description: str = "answers",
                 unit: str = "tokens") -> None:
        from macfleet.progress import Bar

        self.bar = Bar(description, target, unit=unit, completed=start, report=report,
                       every_s=every_s)

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        self.bar.update(done, extra, force=force)

    def close(self, done: int | None = None) -> None:
        self.bar.close(done)


def generate_dataset(lm: LoadedModel, path: Path, target_tokens: int, *, fingerprint: str,
                     batch: int = DEFAULT_BATCH, max_answer: int = DEFAULT_MAX_ANSWER,
                     seed: int = 0, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                     report: Callable[[str], None] | None = None,
                     generator: Callable[..., Iterator[Sample]] = generate_samples) -> Manifest:
    """Add the verifier's answers to `path` until it holds `target_tokens` answer tokens; the
    questions the verifier wrote itself (`<path>/questions.jsonl`, self_instruct) are one of
    the sources when there are any (`prompts.DEFAULT_MIX`).
    generator: batchgen.generate_samples (continuous refill: the CPU's) or generate_waves
    (fixed waves: an accelerator's)."""
    m = open_manifest(path, lm, fingerprint)
    if m.answer_tokens >= target_tokens:
        return m
    timing = Timing(**{k: v for k, v in m.timing.items() if k in Timing.__dataclass_fields__})
    prog = Progress(target_tokens, m.answer_tokens, report)
    buf: list[Sample] = []
    done = m.answer_tokens
    t_run = time.perf_counter()
    seconds0 = m.seconds

    def flush() -> None:
        t0 = time.perf_counter()
        info = write_shard(path, len(m.shards), buf)
        with open(path / KEYS, "a") as f:
            f.write("".join(s.prompt.key + "\n" for s in buf))
        m.shards.append(info)
        m.seconds = seconds0 + time.perf_counter() - t_run
        m.timing = {**asdict(timing), "write": m.timing.get("write", 0.0)
                    + time.perf_counter() - t0}
        write_atomic(path / MANIFEST, m.to_json())
        buf.clear()

    from macfleet.distill.self_instruct import read_questions

    prompts = iter_prompts(seed=seed, skip=done_keys(path), extra=read_questions(path))
    gen = generator(lm, prompts, batch=batch, max_answer=max_answer, timing=timing,
                    on_step=lambda rows: prog.update(done, f"batch {rows}"))
    try:
        for s in gen:
            buf.append(s)
            done += s.answer_tokens
            if sum(len(b.tokens) for b in buf) >= shard_tokens:
                flush()
                prog.update(done, f"{len(m.shards)} shards", force=True)
            if done >= target_tokens:
                break
    finally:
        gen.close()
        if buf:
            flush()
        prog.close(done)
    return m


def missing_hidden(path: Path) -> list[ShardInfo]:
    """Shards whose hidden-state cache is absent."""
    return [s for s in Manifest.read(path).shards
            if not (path / f"{s.name}.hidden.npy").is_file()]


@dataclass(frozen=True)
class Rebuilt:
    shards: int
    tokens: int
    seconds: float
    top_mismatch: int  # positions where this machine's argmax differs from the stored one


FEATURES_BATCH_TOKENS = 4096  # padded tokens per rebuild forward; an accelerator takes ~64k


def length_batches(spans: Sequence[tuple[int, int]], budget: int) -> list[list[int]]:
    """Indices of `spans` grouped for padded forwards: sorted by length, each group's padded
    size (rows x its longest) within `budget` tokens (a longer span goes alone)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = spans[i][1] - spans[i][0]  # the longest so far: sorted ascending
        if cur and n * (len(cur) + 1) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def rebuild_hidden(lm: LoadedModel, path: Path, *, fingerprint: str,
                   report: Callable[[str], None] | None = None,
                   batch_tokens: int = FEATURES_BATCH_TOKENS) -> Rebuilt:
    """Recompute the missing hidden-state files: a forward over the tokens each sample's
    verifier was fed (its prompt and answer), the same rows generation captured. Samples of
    similar length share one forward, right-padded: under the causal mask a row's positions
    never see its padding, so each row's states are its own forward's (up to the last bits of
    a batched matmul). The stored greedy targets (`top`) are kept; where this machine's argmax
    differs (float paths differ in the last bits between CPUs) the count is reported, not
    silently rewritten."""
    import mlx.core as mx

    from macfleet.distill.batchgen import _forward

    m = Manifest.read(path)
    check_verifier(m, path, lm, fingerprint)
    todo = missing_hidden(path)
    total = sum(s.tokens for s in todo)
    prog = Progress(total, 0, report, description="hidden states", unit="positions")
    t0, done, mismatch = time.perf_counter(), 0, 0
    for s in todo:
        toks = np.load(path / f"{s.name}.tokens.npy")
        top = np.load(path / f"{s.name}.top.npy")
        offs = np.load(path / f"{s.name}.offsets.npy")
        hidden = np.empty((len(toks), m.hidden_size), dtype=np.float16)
        spans = list(zip(offs[:-1].tolist(), offs[1:].tolist()))
        for group in length_batches(spans, batch_tokens):
            width = max(spans[i][1] - spans[i][0] for i in group)
            x = np.zeros((len(group), width), dtype=np.uint32)
            for row, i in enumerate(group):
                a, b = spans[i]
                x[row, : b - a] = toks[a:b]
            h, am = _forward(lm, mx.array(x), None)
            h = h.astype(mx.float16)
            mx.eval(h, am)
            hn, an = np.array(h), np.array(am)
            for row, i in enumerate(group):
                a, b = spans[i]
                hidden[a:b] = hn[row, : b - a]
                mismatch += int((an[row, : b - a] != top[a:b]).sum())
                done += b - a
            prog.update(done, f"shard {s.name}")
        tmp = path / f"{s.name}.hidden.tmp.npy"
        np.save(tmp, hidden)
        os.replace(tmp, path / f"{s.name}.hidden.npy")
    prog.close(done)
    return Rebuilt(len(todo), total, time.perf_counter() - t0, mismatch)


# -- reading ------------------------------------------------------------------------------


def load_chunks(path: Path, max_len: int = 1 << 30, skip_missing: bool = False
                ) -> list[FeatureChunk]:
    """Every sample as a FeatureChunk of memory-mapped views (nothing is read until used);
    skip_missing: leave out the shards without hidden states instead of refusing."""
    m = Manifest.read(path)
    missing = missing_hidden(path)
    if missing and not skip_missing:
        raise DatasetError(f"{path}: {len(missing)} shard(s) have no hidden states (a copied "
                           f"dataset?): run `macfleet distill --dataset {path} --stage features`")
    out: list[FeatureChunk] = []
    skip = {s.name for s in missing}
    for s in m.shards:
        if s.name in skip:
            continue
        arr = {k: np.load(path / f"{s.name}.{k}.npy", mmap_mode="r")
               for k in ("tokens", "hidden", "top")}
        offs = np.load(path / f"{s.name}.offsets.npy")
        groups = _groups(path / f"{s.name}.meta.jsonl", len(offs) - 1)
        for a, b, g in zip(offs[:-1], offs[1:], groups):
            for c in range(int(a), int(b), max_len):
                e = min(int(b), c + max_len)
                if e - c >= 8:
                    out.append(FeatureChunk(arr["tokens"][c:e], arr["hidden"][c:e],
                                            arr["top"][c:e], True, g))
    return out


def _groups(meta: Path, n: int) -> list[str]:
    """Each sample's prompt group; a dataset written before groups were recorded falls back
    to the sample's own key (held out sample by sample, as then)."""
    try:
        rows = [json.loads(line) for line in meta.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        rows = []
    out = [r.get("group") or r.get("key", "") for r in rows[:n]]
    return out + [""] * (n - len(out))


def answers(path: Path) -> list[np.ndarray]:
    """The verifier's answer of every sample (its final token included), for an answer store."""
    m = Manifest.read(path)
    out: list[np.ndarray] = []
    for s in m.shards:
        toks = np.load(path / f"{s.name}.tokens.npy", mmap_mode="r")
        top = np.load(path / f"{s.name}.top.npy", mmap_mode="r")
        offs = np.load(path / f"{s.name}.offsets.npy")
        npr = np.load(path / f"{s.name}.nprompt.npy")
        for (a, b), n in zip(zip(offs[:-1], offs[1:]), npr):
            out.append(np.concatenate([toks[a + n : b], top[b - 1 : b]]).astype(np.int64))
    return out


def store_answers(store: Datastore) -> list[np.ndarray]:
    """The answers an answer store holds, in order (split at the separators)."""
    cuts = np.flatnonzero(store.tokens == SEPARATOR)
    starts = np.concatenate([[0], cuts[:-1] + 1]) if cuts.size else np.zeros(0, np.int64)
    return [store.tokens[a:b] for a, b in zip(starts.tolist(), cuts.tolist()) if b > a]


def merged_store(store: Datastore, more: Sequence[Sequence[int]]) -> Datastore:
    """The store plus the answers `more`, an answer already held dropped."""
    seen = {a.tobytes() for a in store_answers(store)}
    keep = list(store_answers(store))
    for a in more:
        arr = np.asarray(a, dtype=np.uint16)
        if arr.size and arr.tobytes() not in seen:
            seen.add(arr.tobytes())
            keep.append(arr)
    return Datastore.build(keep)


def save_store(store: Datastore, path: Path) -> Path:
    """Write the store's tokens to PATH.npy (`Datastore.load` reads it back)."""
    p = Path(path).with_suffix(".npy")
    np.save(p, store.tokens)
    return p


def token_counts(path: Path, vocab: int) -> np.ndarray:
    """How often each id occurs among the dataset's tokens and the verifier's greedy targets
    (what `choose_draft_vocab` counts over loaded chunks), without the hidden states: to order
    an existing head's draft vocabulary (`frequency_order(..., among=ids)`)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for s in Manifest.read(path).shards:
        for kind in ("tokens", "top"):
            a = np.load(path / f"{s.name}.{kind}.npy", mmap_mode="r")
            counts += np.bincount(np.asarray(a[a >= 0], dtype=np.int64), minlength=vocab)[:vocab]
    return counts
