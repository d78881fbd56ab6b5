"""Offline training text for the draft head.

Two sources, both offline:
* answers the verifier generates itself (greedy) for a built-in list of varied prompts: slow
  (one decode step per token) but the most valuable, because the head must predict what THIS
  verifier says; they are cached in a JSON file next to the output so a resumed run reuses them;
* text files: `--data` files or directories (.txt/.md/.py/.rst), or by default the Markdown,
  reST and Python docstrings already on this machine (the installed Python's stdlib and
  site-packages), which every macfleet install has.
"""

from __future__ import annotations

import ast
import json
import logging
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx.core as mx

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
DEFAULT_FILE_CHARS = 400_000  # total characters read from local files by default

PROMPTS = (
    "What is a hash table?",
    "Write a haiku about rain.",
    "Explain photosynthesis in simple terms.",
    "How do I reverse a list in Python?",
    "Give me three tips for a job interview.",
    "What causes the seasons on Earth?",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between TCP and UDP?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a neural network learn?",
    "Write a Python function that checks if a number is prime.",
    "What are the health benefits of drinking water?",
    "Explain recursion to a ten-year-old.",
    "What is the capital of Australia and why was it chosen?",
    "Write an email asking my manager for a day off.",
    "How do vaccines work?",
    "What is the Pythagorean theorem?",
    "Suggest a healthy breakfast.",
    "Explain what a black hole is.",
    "How can I improve my sleep?",
    "Write a limerick about a cat.",
    "What is the difference between weather and climate?",
    "How do I sort a dictionary by value in Python?",
    "Why is the sky blue?",
)


def generate_answers(lm, prompts: Sequence[str], max_tokens: int,
                     progress=None) -> list[list[int]]:
    """Prompt + the verifier's own greedy answer, as token ids (plain mlx-lm decoding)."""
    from mlx_lm.generate import generate_step

    from macfleet.engine.text import encode_prompt

    out = []
    for q in prompts:
        ids = encode_prompt(lm.tokenizer, q, chat=True)
        ans: list[int] = []
        for tok, _ in generate_step(mx.array(ids, dtype=mx.uint32), lm.model,
                                    max_tokens=max_tokens):
            tok = int(tok)
            if tok in lm.eos_ids:
                break
            ans.append(tok)
            if progress is not None:
                progress(1)
        out.append(ids + ans)
    return out


def cached_answers(lm, cache_file: Path, prompts: Sequence[str], max_tokens: int,
                   progress=None) -> list[list[int]]:
    """Generated answers, read from / added to `cache_file` (keyed by prompt and length)."""
    have: dict = {}
    if cache_file.is_file():
        have = json.loads(cache_file.read_text())
    key = f"{lm.spec}|{max_tokens}"
    got = have.setdefault(key, {})
    for q in prompts:
        if q not in got:  # one at a time, saved as we go: generation is the slow part
            got[q] = generate_answers(lm, [q], max_tokens, progress)[0]
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            cache_file.write_text(json.dumps(have))
    return [got[q] for q in prompts]


def _docstrings(src: str) -> Iterator[str]:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node)
            if d and len(d) > 200:
                yield d


def iter_files(paths: Sequence[str | Path]) -> Iterator[Path]:
    for p in map(Path, paths):
        p = p.expanduser()
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES
                              and f.is_file())
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")


def read_texts(paths: Sequence[str | Path], max_chars: int | None = None) -> list[str]:
    """Whole files for --data paths (.py files too: code is text the verifier sees)."""
    out, total = [], 0
    for f in iter_files(paths):
        try:
            t = f.read_text(encoding="utf-8", errors="ignore").strip()
        except OSError as e:
            log.warning("skipping %s: %s", f, e)
            continue
        if len(t) < 200:
            continue
        out.append(t)
        total += len(t)
        if max_chars is not None and total >= max_chars:
            break
    return out


def default_local_texts(max_chars: int = DEFAULT_FILE_CHARS) -> list[str]:
    """Docstrings of the stdlib and Markdown/reST of installed packages: prose, on every host."""
    out: list[str] = []
    total = 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    files = sorted(stdlib.glob("*.py")) + sorted(site.glob("*/*.md"))[:200]
    for f in files:
        try:
            src = f.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        parts = list(_docstrings(src)) if f.suffix == ".py" else [src]
        for t in parts:
            out.append(t)
            total += len(t)
        if total >= max_chars:
            break
    return out
