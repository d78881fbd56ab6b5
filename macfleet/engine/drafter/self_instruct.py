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
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from macfleet.engine.drafter.prompts import HELD_OUT_SUBJECTS, TOPICS, Prompt
from macfleet.engine.models import LoadedModel

QUESTIONS = "questions.jsonl"

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


def seeds(rounds: int = 3, seed: int = 0) -> list[Seed]:
    """Every seed request (subjects of the topic and chat sources, none naming a held-out
    subject), each `rounds` times (each round samples another list), shuffled
    deterministically."""
    from macfleet.engine.drafter.chat_prompts import SITUATIONS, THINGS

    subjects = [(s, TOPIC_ASKS) for s in TOPICS] + [(s, THING_ASKS) for s in THINGS] + [
        (s, SITUATION_ASKS) for s in SITUATIONS]
    out = [Seed(ASK.format(what=a.format(s=s)), f"self:{s}") for s, asks in subjects
           for a in asks if not any(h in s.lower() for h in HELD_OUT_SUBJECTS)]
    out = list({s.text: s for s in out}.values())  # a subject in two lists: asked once
    out = [Seed(s.text, s.group, r) for r in range(rounds) for s in out]
    random.Random(seed).shuffle(out)
    return out


_ITEM = re.compile(r"^\s*\d{1,2}\s*[.)]\s+(.*\S)\s*$")
_LABEL = re.compile(r"^[^?]{1,30}:\s")  # "Destination: How can I..." - a heading, not a request
VERBS = ("write", "explain", "describe", "give", "tell", "help", "suggest", "create", "list",
         "show", "make", "compare", "implement", "build", "convert", "find", "plan", "design")


def parse_list(text: str) -> list[str]:
    """The items of a numbered list, cleaned (markdown emphasis and quotes stripped), kept when
    they read like a request (a question, or an instruction opening with a verb; 4-40 words,
    15-240 characters, mostly letters; no heading), never one about a held-out subject or a
    list request like the seed, each once."""
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
        seen.add(low)
        out.append(q)
    return out


def _rows(path: Path) -> list[dict]:
    """The questions file's records (a line cut by a stopped run is skipped)."""
    f = path / QUESTIONS
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("seed"), str):
            out.append(r)
    return out


def read_questions(path: Path) -> list[Prompt]:
    """The questions a dataset holds (source `self`), in the order they were written."""
    return [Prompt("self", str(r["text"]), str(r.get("group", "")))
            for r in _rows(path) if r.get("text")]  # "": a seed recorded as asked


def sample_lists(lm: LoadedModel, texts: Sequence[str], *, max_tokens: int, temperature: float,
                 rng_seed: int) -> list[str]:
    """Sampled answers to `texts` in ONE wave: a left-padded prefill, then one forward per
    step until every row has stopped (EOS or `max_tokens`)."""
    import mlx.core as mx

    from macfleet.engine.drafter.batchgen import left_padded
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


def generate_questions(lm: LoadedModel, path: Path, n_seeds: int, *, batch: int = 32,
                       max_tokens: int = 220, temperature: float = 0.6, rounds: int = 3,
                       report: Callable[[str], None] | None = None) -> Asked:
    """Ask the verifier for lists of questions until `n_seeds` seeds are asked in all;
    append the kept questions to `<path>/questions.jsonl` after each wave (resumable)."""
    path.mkdir(parents=True, exist_ok=True)
    asked = {r["seed"] for r in _rows(path)}
    todo = [s for s in seeds(rounds) if s.key not in asked][: max(0, n_seeds - len(asked))]
    have = {p.key for p in read_questions(path)}
    t0, kept = time.perf_counter(), 0
    for w in range(0, len(todo), batch):
        wave = todo[w : w + batch]
        lists = sample_lists(lm, [s.text for s in wave], max_tokens=max_tokens,
                             temperature=temperature, rng_seed=len(asked) + w)
        lines = []
        for s, text in zip(wave, lists):
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
        if report:
            el = time.perf_counter() - t0
            report(f"questions: {w + len(wave)}/{len(todo)} seeds, {kept} kept, "
                   f"{el:.0f} s")
    return Asked(len(todo), kept, len(have), time.perf_counter() - t0)


def question_prompts(questions: Sequence[Prompt], seed: int = 0) -> Iterator[Prompt]:
    """The dataset's questions in a deterministic shuffled order."""
    qs = list(questions)
    random.Random(seed).shuffle(qs)
    yield from qs
