"""Where the training prompts and answers a held-out prompt is checked against come from.

* `template_prompts`: every prompt the offline template families can write, whatever the seed
  (code, not data: the CI test reads them), with their word problems for the dataset's seed
  and, optionally, the local-text prompts this machine's Python would give.
* `dataset_prompts`: a dataset's questions (questions.jsonl), the subjects the verifier named
  (subtopics.jsonl) and, given its tokenizer, the user turn of every sample in its shards.
* `dataset_answers`: the verifier's answers a head was trained on (dataset.answers).

A dataset is a directory or a tar archive of one (the committed
results/distill-smollm2-7.6M.tar.xz): `open_dataset` unpacks an archive's records (never its
hidden states) into a temporary directory.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from macfleet.distill import prompts as P

PROBLEMS = 5000  # word problems drawn (their numbers are random; the dataset holds ~1,400)


def template_prompts(*, problems: int = PROBLEMS, local: bool = False
                     ) -> Iterator[tuple[str, str]]:
    """(text, source) of every templated training prompt: each chat family's whole space
    (source "chat:<kind>"), every topic phrasing with every second topic ("topics"), every
    code request ("code"), `problems` word problems of the dataset's seed ("problems") and,
    when `local`, this machine's local-text prompts ("local": stdlib code and docstrings)."""
    from macfleet.distill.chat_prompts import every_chat_prompt

    yield from ((text, f"chat:{kind}") for kind, text in every_chat_prompt())
    for t in P.TOPICS:
        for tpl in P.TOPIC_TEMPLATES:
            us = P.TOPICS if "{u}" in tpl else ("",)
            yield from ((tpl.format(t=t, u=u), "topics") for u in us)
    for task, lang, tpl in itertools.product(P.CODE_TASKS, sorted(set(P.LANGUAGES)),
                                             P.CODE_TEMPLATES):
        yield tpl.format(task=task, lang=lang), "code"
    for p in itertools.islice(P.problem_prompts(random.Random(0)), problems):
        yield p.text, "problems"
    if local:
        yield from ((p.text, "local") for p in P.local_prompts(random.Random(0)))


def _jsonl(path: Path) -> Iterator[dict]:
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            yield r


def user_turn(text: str) -> str:
    """The last user turn of a decoded prompt (ChatML: between '<|im_start|>user' and
    '<|im_end|>'); the whole text when it has no such markers."""
    head, sep, tail = text.rpartition("<|im_start|>user")
    if not sep:
        return text.strip()
    return tail.split("<|im_end|>", 1)[0].strip()


def shard_prompts(path: Path) -> Iterator[np.ndarray]:
    """The prompt tokens (chat template included) of every sample of a dataset's shards."""
    from macfleet.distill.dataset import Manifest

    for s in Manifest.read(path).shards:
        toks = np.load(path / f"{s.name}.tokens.npy", mmap_mode="r")
        offs = np.load(path / f"{s.name}.offsets.npy")
        npr = np.load(path / f"{s.name}.nprompt.npy")
        for a, n in zip(offs[:-1].tolist(), npr.tolist()):
            yield np.asarray(toks[a:a + n])


def dataset_prompts(path: Path, tokenizer=None) -> Iterator[tuple[str, str]]:
    """(text, source) of a dataset's own prompts: its questions ("questions"), the subjects
    its verifier named ("subtopics") and, given the verifier's tokenizer, the user turn of
    every sample it holds ("shards": what the head was trained on, whatever made it)."""
    for r in _jsonl(path / "questions.jsonl"):
        if isinstance(r.get("text"), str) and r["text"]:
            yield r["text"], "questions"
    for r in _jsonl(path / "subtopics.jsonl"):
        if isinstance(r.get("subject"), str) and r["subject"]:
            yield r["subject"], "subtopics"
    if tokenizer is not None and (path / "manifest.json").is_file():
        for ids in shard_prompts(path):
            yield user_turn(tokenizer.decode([int(t) for t in ids])), "shards"


def dataset_verifier(path: Path) -> str | None:
    """The verifier spec a dataset's tokens are of (its manifest), None without one."""
    try:
        v = json.loads((path / "manifest.json").read_text()).get("verifier")
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, str) else None


def dataset_answers(path: Path) -> list[np.ndarray]:
    """The verifier's answers a dataset holds (what a head trained on it learnt from)."""
    from macfleet.distill.dataset import answers

    return answers(path)


def _wanted(name: str) -> bool:
    """An archive member the checks read: records, prompts and tokens, not hidden states."""
    base = name.rsplit("/", 1)[-1]
    return base.endswith((".jsonl", ".json")) or base.endswith(
        tuple(f".{k}.npy" for k in ("tokens", "top", "offsets", "nprompt")))


@contextlib.contextmanager
def open_dataset(path: Path) -> Iterator[Path]:
    """A dataset directory: `path` itself, or a tar archive's records unpacked into a
    temporary directory (removed after). ValueError: neither."""
    path = Path(path)
    if path.is_dir():
        yield path
        return
    if not (path.is_file() and tarfile.is_tarfile(path)):
        raise ValueError(f"{path}: not a dataset directory or a tar archive of one")
    with tempfile.TemporaryDirectory(prefix="macfleet-dataset-") as tmp, \
            tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and _wanted(m.name)]
        tar.extractall(tmp, members=members, filter="data")
        manifests = sorted(Path(tmp).rglob("manifest.json"))
        root = manifests[0].parent if manifests else Path(tmp)
        yield root


def archive_questions(path: Path) -> list[str]:
    """The questions of a dataset archive (its questions.jsonl only, read in one pass)."""
    with tarfile.open(path) as tar:
        for m in tar:
            if m.isfile() and m.name.rsplit("/", 1)[-1] == "questions.jsonl":
                f = tar.extractfile(m)
                if f is None:
                    break
                rows = (json.loads(line) for line in f.read().decode().splitlines() if line)
                return [r["text"] for r in rows if isinstance(r, dict)
                        and isinstance(r.get("text"), str) and r["text"]]
    return []


def held_out_texts(held_out: dict | None = None) -> dict[str, Sequence[str]]:
    """kind -> what a user typed in that held-out request (prompts.user_texts)."""
    return {k: P.user_texts(p) for k, p in (held_out or P.HELD_OUT).items()}


def unseen_texts() -> dict[str, Sequence[str]]:
    """'SET/kind' -> what a user typed in that request, for every prompt set a benchmark
    calls held out or unseen (prompts.UNSEEN_SETS)."""
    return {f"{name}/{k}": texts for name, prompts in P.UNSEEN_SETS.items()
            for k, texts in held_out_texts(prompts).items()}
