"""Self-instruct: the verifier writes the questions its drafter is then trained on.

Template prompts cross a few phrasings with lists of subjects, so their answers share openings
and shapes. Asked "Write a numbered list of 10 different questions beginners ask about baking
bread", the verifier itself names the things people ask ("What's the best type of flour for
bread?"), in the words a chat model expects. Its lists are SAMPLED (a 135M model decoding
greedily repeats one line ten times), parsed into single questions, filtered (length, shape,
the benchmark's held-out subjects) and deduplicated. The answers to them are then generated
greedily like any other prompt (`prompts.iter_prompts(extra=...)`, source `self`).

The questions of a dataset live in `<dataset>/questions.jsonl`, one `{"text", "group", "seed"}`
per line, appended a wave at a time; a run resumes after the seeds already asked.

The listed subjects (a few hundred) give a few thousand seeds, tens of thousands of questions:
a few million answer tokens. A drafter wants a hundred times that, so when the seeds run out
the verifier names the subtopics of a subject ("Write a numbered list of 10 specific
subtopics of dogs" -> "Dog training", "Dog health", ...), breadth first, down to
`MAX_DEPTH`; each new subject brings its own seeds. Subtopics live in
`<dataset>/subtopics.jsonl`, one `{"parent", "subject", "root", "depth"}` per line (a parent
asked with nothing new to say is recorded with subject ""). A subtopic keeps the group of the
listed subject it descends from, so held-out figures still hold out whole subjects.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from macfleet.distill.prompts import HELD_OUT_SUBJECTS, TOPICS, Prompt, held_out_index
from macfleet.engine.models import LoadedModel

QUESTIONS = "questions.jsonl"
SUBTOPICS = "subtopics.jsonl"
MAX_DEPTH = 3  # subtopics of subtopics of subtopics of a listed subject, at most

ASK = "Write a numbered list of 10 different {what}."
TOPIC_ASKS = ("questions that people ask a helpful assistant about {s}",
              "questions that beginners ask about {s}")
THING_ASKS = ("questions a curious child might ask about {s}",
              "questions that people ask a helpful assistant about {s}")
SITUATION_ASKS = ("questions people ask when planning {s}",
                  "questions that people ask a helpful assistant about {s}")
# No code seeds: asked for lists of coding tasks, a 135M verifier writes code instead of a list
# (the code source's templated tasks cover code).


@dataclass(frozen=True)
class Seed:
    """One request for a list of questions; `group` is its subject (held out as one)."""

    text: str
    group: str
    round: int = 0  # the same request asked again samples another list

    @property
    def key(self) -> str:
        return Prompt("seed", f"{self.text} #{self.round}").key


@dataclass(frozen=True)
class Subject:
    """What seeds ask about: a listed subject (depth 0) or a subtopic the verifier named."""

    name: str
    root: str  # the listed subject it descends from: its group
    depth: int = 0
    asks: tuple[str, ...] = TOPIC_ASKS

    @property
    def group(self) -> str:
        return f"self:{self.root}"


SUBTOPIC_ASK = "Write a numbered list of 10 specific subtopics of {s}."


def _held_out(name: str) -> bool:
    return any(h in name.lower() for h in HELD_OUT_SUBJECTS)


def listed_subjects() -> list[Subject]:
    """The subjects of the topic and chat sources (none naming a held-out subject), each
    once."""
    from macfleet.distill.chat_prompts import SITUATIONS, THINGS

    subjects = [Subject(s, s, 0, TOPIC_ASKS) for s in TOPICS] + [
        Subject(s, s, 0, THING_ASKS) for s in THINGS] + [
        Subject(s, s, 0, SITUATION_ASKS) for s in SITUATIONS]
    return [s for s in subjects if not _held_out(s.name)]


def seeds(rounds: int = 3, seed: int = 0, found: Sequence[Subject] = ()) -> list[Seed]:
    """Every seed request, each `rounds` times (each round samples another list): the listed
    subjects' shuffled deterministically, then those of `found` subtopics (in the order they
    were found, each subject's rounds together). Never one naming a held-out subject."""
    def of(subjects: Sequence[Subject]) -> list[Seed]:
        out = [Seed(ASK.format(what=a.format(s=s.name)), s.group) for s in subjects
               for a in s.asks if not _held_out(s.name)]
        return list({x.text: x for x in out}.values())  # asked once, whoever names it

    base = of(listed_subjects())
    out = [Seed(s.text, s.group, r) for r in range(rounds) for s in base]
    random.Random(seed).shuffle(out)
    known = {s.text for s in base}
    extra = [s for s in of(found) if s.text not in known]
    return out + [Seed(s.text, s.group, r) for s in extra for r in range(rounds)]


_ITEM = re.compile(r"^\s*\d{1,2}\s*[.)]\s+(.*\S)\s*$")
_LABEL = re.compile(r"^[^?]{1,30}:\s")  # "Destination: How can I..." - a heading, not a request
VERBS = ("write", "explain", "describe", "give", "tell", "help", "suggest", "create", "list",
         "show", "make", "compare", "implement", "build", "convert", "find", "plan", "design")


def parse_list(text: str) -> list[str]:
    """The items of a numbered list, cleaned (markdown emphasis and quotes stripped), kept when
    they read like a request (a question, or an instruction opening with a verb; 4-40 words,
    15-240 characters, mostly letters; no heading), never one about a held-out subject, a
    near-copy of a held-out request (prompts.held_out_index) or a list request like the seed,
    each once."""
    out: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        m = _ITEM.match(line)
        if not m:
            continue
        q = m.group(1).replace("**", "").strip().strip('"“”\'').strip()
        words = q.split()
        letters = sum(ch.isalpha() for ch in q)
        if not (4 <= len(words) <= 40 and 15 <= len(q) <= 240 and letters >= 0.6 * len(q)):
            continue
        low = q.lower()
        if not (q.endswith("?") or words[0].lower().strip(",:") in VERBS) or _LABEL.match(q):
            continue
        if "list of" in low or any(h in low for h in HELD_OUT_SUBJECTS) or low in seen:
            continue
        if held_out_index().near_copy_of(q) is not None:  # a near-copy of a held-out request
            continue
        seen.add(low)
        out.append(q)
    return out


_BULLET = re.compile(r"^\s*(?:\d{1,2}\s*[.)]|[-*•])\s+(.*\S)\s*$")
_CUT = re.compile(r":|\s[-–—]\s|\(")  # "Key management: the process of ..." -> the name


def _plain(name: str) -> str:
    low = " ".join(name.lower().split())
    return low[4:] if low.startswith("the ") else low


def parse_subjects(text: str, parent: str) -> list[str]:
    """The subjects a list of subtopics names: each numbered or bulleted item up to its first
    colon, dash or parenthesis, markdown and quotes stripped, kept when it reads like a name
    (1-6 words, 3-50 characters, letters only but for spaces, hyphens, apostrophes and '&'),
    is not the parent itself, and names no held-out subject; each once."""
    out: list[str] = []
    seen = {_plain(parent)}
    for line in text.splitlines():
        m = _BULLET.match(line)
        if not m:
            continue
        name = _CUT.split(m.group(1).replace("**", ""), maxsplit=1)[0]
        name = name.strip().strip('"“”\'.,;').strip()
        words = name.split()
        if not (1 <= len(words) <= 6 and 3 <= len(name) <= 50):
            continue
        if not all(ch.isalpha() or ch in " -'&" for ch in name) or _held_out(name):
            continue
        if _plain(name) in seen:
            continue
        seen.add(_plain(name))
        out.append(name)
    return out


def _jsonl(path: Path, name: str, need: str) -> list[dict]:
    """The records of `<path>/<name>` that carry the string field `need` (a line cut by a
    stopped run is skipped)."""
    f = path / name
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get(need), str):
            out.append(r)
    return out


def _rows(path: Path) -> list[dict]:
    """The questions file's records."""
    return _jsonl(path, QUESTIONS, "seed")


@dataclass(frozen=True)
class Subjects:
    """The subtopics a dataset's verifier has named so far, and which subjects it was asked
    about (read from `<dataset>/subtopics.jsonl`)."""

    found: tuple[Subject, ...]
    expanded: frozenset[str]  # _plain names of the subjects already asked for subtopics

    def known(self) -> set[str]:
        return {_plain(s.name) for s in (*listed_subjects(), *self.found)}

    def to_expand(self, max_depth: int = MAX_DEPTH) -> list[Subject]:
        """Subjects not asked for subtopics yet, shallowest first (breadth first)."""
        todo = [s for s in (*listed_subjects(), *self.found)
                if s.depth < max_depth and _plain(s.name) not in self.expanded]
        return sorted(todo, key=lambda s: s.depth)  # stable: listed, then found order


def read_subjects(path: Path) -> Subjects:
    found: dict[str, Subject] = {}
    expanded: set[str] = set()
    for r in _jsonl(path, SUBTOPICS, "parent"):
        expanded.add(_plain(r["parent"]))
        name = r.get("subject")
        if isinstance(name, str) and name and _plain(name) not in found:
            found[_plain(name)] = Subject(name, str(r.get("root", r["parent"])),
                                          int(r.get("depth", 1)))
    return Subjects(tuple(found.values()), frozenset(expanded))


def expand_subjects(lm: LoadedModel, path: Path, subjects: Subjects, wave: Sequence[Subject],
                    *, max_tokens: int, temperature: float, rng_seed: int) -> Subjects:
    """Ask the verifier for the subtopics of `wave` (one batch, subjects of `subjects`); append
    what is new to `<path>/subtopics.jsonl` (every parent recorded as asked). Returns
    `subjects` with them: what `read_subjects` would now read."""
    known = subjects.known()
    lists = sample_lists(lm, [SUBTOPIC_ASK.format(s=s.name) for s in wave],
                         max_tokens=max_tokens, temperature=temperature, rng_seed=rng_seed)
    lines, added = [], []
    for parent, text in zip(wave, lists):
        new = [n for n in parse_subjects(text, parent.name) if _plain(n) not in known]
        known |= {_plain(n) for n in new}
        added += [Subject(n, parent.root, parent.depth + 1) for n in new]
        lines += [json.dumps({"parent": parent.name, "subject": n, "root": parent.root,
                              "depth": parent.depth + 1}) for n in new or [""]]
    with open(path / SUBTOPICS, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    return Subjects((*subjects.found, *added),
                    subjects.expanded | {_plain(p.name) for p in wave})


def read_questions(path: Path) -> list[Prompt]:
    """The questions a dataset holds (source `self`), in the order they were written."""
    return [Prompt("self", str(r["text"]), str(r.get("group", "")))
            for r in _rows(path) if r.get("text")]  # "": a seed recorded as asked


def sample_lists(lm: LoadedModel, texts: Sequence[str], *, max_tokens: int, temperature: float,
                 rng_seed: int) -> list[str]:
    """Sampled answers to `texts` in ONE wave: a left-padded prefill, then one forward per
    step until every row has stopped (EOS or `max_tokens`)."""
    import mlx.core as mx

    from macfleet.distill.batchgen import left_padded
    from macfleet.engine.layers import head_logits, run_layers
    from macfleet.engine.text import encode_prompt

    ids = [encode_prompt(lm.tokenizer, t, chat=True) for t in texts]
    x, _, cache = left_padded(lm, ids)
    inner = lm.model.model
    key = mx.random.key(rng_seed)
    eos = np.array(sorted(lm.eos_ids), dtype=np.int64)
    out = np.zeros((len(ids), max_tokens), dtype=np.int64)
    done = np.zeros(len(ids), dtype=bool)
    n = 0
    while n < max_tokens and not done.all():
        h = run_layers(inner.layers, inner.embed_tokens(x), cache)
        logits = head_logits(lm.model, h[:, -1]).astype(mx.float32)
        key, sub = mx.random.split(key)
        tok = mx.random.categorical(logits / temperature, key=sub)
        mx.eval(tok)
        t = np.array(tok).astype(np.int64)
        out[:, n] = np.where(done, eos[0] if eos.size else 0, t)
        done |= np.isin(t, eos)
        n += 1
        x = tok[:, None].astype(mx.uint32)
    texts_out = []
    for row in out[:, :n]:
        stop = np.flatnonzero(np.isin(row, eos))
        texts_out.append(lm.tokenizer.decode(row[: stop[0] if stop.size else n].tolist()))
    return texts_out


@dataclass(frozen=True)
class Asked:
    seeds: int  # asked this run
    questions: int  # kept this run
    total: int  # questions the dataset now holds
    seconds: float
    subjects: int = 0  # subtopics the verifier named this run


def generate_questions(lm: LoadedModel, path: Path, n_seeds: int, *, batch: int = 32,
                       max_tokens: int = 220, temperature: float = 0.6, rounds: int = 3,
                       max_depth: int = MAX_DEPTH,
                       report: Callable[[str], None] | None = None,
                       progress: Callable[[int, int], None] | None = None) -> Asked:
    """Ask the verifier for lists of questions until `n_seeds` seeds are asked in all;
    append the kept questions to `<path>/questions.jsonl` after each wave (resumable). When
    the seeds run out, have it name subtopics (`expand_subjects`, breadth first, down to
    `max_depth`) and ask about those; stops early only when no subject is left to expand.
    progress(seeds asked, seeds to ask) after each wave."""
    path.mkdir(parents=True, exist_ok=True)
    asked = {r["seed"] for r in _rows(path)}
    want = max(0, n_seeds - len(asked))
    have = {p.key for p in read_questions(path)}
    t0, kept, done, found = time.perf_counter(), 0, 0, 0
    subjects = read_subjects(path)
    pending = None  # the seeds not asked yet, in order (listed again after an expansion)
    while done < want:
        if pending is None:
            pending = [s for s in seeds(rounds, found=subjects.found) if s.key not in asked]
        todo, pending = pending[: min(batch, want - done)], pending[min(batch, want - done):]
        if not todo:
            wave_s = subjects.to_expand(max_depth)[:batch]
            if not wave_s:
                break  # every subject down to max_depth asked: nothing more to ask about
            grown = expand_subjects(lm, path, subjects, wave_s, max_tokens=max_tokens,
                                    temperature=temperature,
                                    rng_seed=1_000_003 + len(subjects.expanded))
            found += len(grown.found) - len(subjects.found)
            subjects, pending = grown, None
            if report:
                report(f"subtopics: {len(subjects.found)} named "
                       f"({len(subjects.expanded)} subjects asked)")
            continue
        lists = sample_lists(lm, [s.text for s in todo], max_tokens=max_tokens,
                             temperature=temperature, rng_seed=len(asked))
        lines = []
        for s, text in zip(todo, lists):
            new = []
            for q in parse_list(text):
                p = Prompt("self", q, s.group)
                if p.key not in have:
                    have.add(p.key)
                    new.append(q)
            kept += len(new)
            # a seed whose list gave nothing new is still recorded as asked
            lines += [json.dumps({"seed": s.key, "text": q, "group": s.group})
                      for q in new or [""]]
        with open(path / QUESTIONS, "a") as f:
            f.write("".join(line + "\n" for line in lines))
        asked |= {s.key for s in todo}
        done += len(todo)
        if progress:
            progress(done, want)
        if report:
            report(f"questions: {done}/{want} seeds, {kept} kept, "
                   f"{time.perf_counter() - t0:.0f} s")
    return Asked(done, kept, len(have), time.perf_counter() - t0, found)
