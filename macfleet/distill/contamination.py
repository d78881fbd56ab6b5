"""Is a held-out prompt really held out? Nearest training prompts and shared answer 8-grams.

The benchmark's held-out prompts (prompts.HELD_OUT) claim to be requests no drafter was
trained on. Two figures check it, both pure functions of their inputs:

* `PromptIndex.nearest`: the training prompt nearest to a held-out one by difflib's ratio
  (2 * matched characters / total characters, on lowercased, whitespace-collapsed text, without
  difflib's "popular character" heuristic), and every training prompt above `NEAR_COPY`. The
  ratio is exact; a vectorised upper bound (difflib's `quick_ratio` over characters folded into
  `BUCKETS` bins, which can only overcount the matches) orders the candidates and stops the
  search once no remaining one can beat the best or reach the threshold: tens of thousands of
  training prompts against a few held-out ones take well under a second per held-out prompt.
* `ngram_shares`: of the 8-grams of a held-out prompt's greedy answer, the share found
  anywhere in a corpus of answers (the answer store, the head's training answers), and the
  largest share found in any single answer of it (one near-copied answer shows up there).

The training prompts come from `training_prompts` (contamination_sources.py): every prompt the
offline template families can write, a dataset's questions and subtopics, and the user turns
of its shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

import numpy as np

NEAR_COPY = 0.8  # a training prompt above this ratio to a held-out one is a near-copy of it
NGRAM = 8  # the answer n-grams counted: the retrieval drafter's key length
BUCKETS = 64  # characters folded into this many bins for the ratio's upper bound
SEPARATOR = 0xFFFF  # between answers of a corpus (the answer store's own separator)


def normalise(text: str) -> str:
    """Lowercased, whitespace runs collapsed to one space, ends stripped."""
    return " ".join(text.lower().split())


def similarity(a: str, b: str) -> float:
    """difflib's ratio of the normalised texts (no autojunk), as `PromptIndex` scores them."""
    m = SequenceMatcher(None, normalise(b), normalise(a), autojunk=False)
    return m.ratio()


@dataclass(frozen=True)
class Match:
    ratio: float
    text: str  # the training prompt, normalised
    source: str  # where it comes from (a template family, "questions", "shards", ...)


@dataclass(frozen=True)
class Nearest:
    """A held-out prompt's nearest training prompt and its near-copies (ratio > threshold,
    nearest first)."""

    query: str
    best: Match | None
    near_copies: tuple[Match, ...]
    threshold: float = NEAR_COPY
    compared: int = 0  # training prompts whose exact ratio was computed (the rest were bounded)

    def to_dict(self, keep: int = 3) -> dict:
        by_source: dict[str, int] = {}
        for m in self.near_copies:
            by_source[m.source] = by_source.get(m.source, 0) + 1
        return {"nearest_ratio": round(self.best.ratio, 4) if self.best else 0.0,
                "nearest_prompt": self.best.text if self.best else None,
                "nearest_source": self.best.source if self.best else None,
                "near_copies": len(self.near_copies), "near_copies_by_source": by_source,
                "near_copy_examples": [m.text for m in self.near_copies[:keep]]}


def _codes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(code points of every text, concatenated [sum L] uint32; lengths [N])."""
    lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    return np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32), lengths


def _char_counts(codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[N, BUCKETS] uint16: each text's characters folded into bins."""
    n = len(lengths)
    rows = np.repeat(np.arange(0, n * BUCKETS, BUCKETS, dtype=np.int32), lengths)
    flat = np.bincount(rows + (codes % BUCKETS).astype(np.int32), minlength=n * BUCKETS)
    return flat.reshape(n, BUCKETS).astype(np.uint16)


TABLE_BITS = 20  # trigrams hashed into 2**20 slots (a query's ~100 rarely collide)


def _trigrams(codes: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hashes [M] uint32 < 2**TABLE_BITS, rows [M] int32) of every character trigram inside
    each text."""
    rows = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    if len(codes) < 3:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.int32)
    h = codes[:-2] * np.uint32(0x9E3779B1)  # multiplicative hashing, wrapping in 32 bits
    h ^= codes[1:-1] * np.uint32(0x85EBCA77)
    h ^= codes[2:] * np.uint32(0xC2B2AE3D)
    h >>= np.uint32(32 - TABLE_BITS)
    same = rows[:-2] == rows[2:]  # the trigram lies inside one text
    return h[same], rows[:-2][same]


TOP = 64  # the exact ratio is computed for the training prompts of most shared trigrams ...
DICE_FLOOR = 0.4  # ... and for every one sharing at least this Dice share of trigrams


class PromptIndex:
    """Training prompts (normalised, each once, the first source kept), ready for `nearest`."""

    def __init__(self, prompts: Iterable[tuple[str, str]]) -> None:
        seen: dict[str, str] = {}
        for text, source in prompts:
            t = normalise(text)
            if t and t not in seen:
                seen[t] = source
        self.texts = list(seen)
        self.sources = list(seen.values())
        codes, self.lengths = _codes(self.texts)
        self.counts = _char_counts(codes, self.lengths)
        hashes, rows = _trigrams(codes, self.lengths)
        self.hashes = hashes
        self.starts = np.searchsorted(rows, np.arange(len(self.texts)))  # rows are sorted
        self.n_trigrams = np.bincount(rows, minlength=len(self.texts))

    def __len__(self) -> int:
        return len(self.texts)

    def source_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sources:
            out[s] = out.get(s, 0) + 1
        return out

    def bounds(self, query: str) -> np.ndarray:
        """[N] an upper bound of every training prompt's ratio to `query` (normalised):
        difflib's quick_ratio over folded characters."""
        codes, ql = _codes([query])
        matches = np.minimum(self.counts, _char_counts(codes, ql)).sum(axis=1, dtype=np.int64)
        return 2.0 * matches / np.maximum(self.lengths + ql[0], 1)

    def dice(self, query: str) -> np.ndarray:
        """[N] the Dice share of character trigrams (counted with repeats) each training
        prompt shares with `query` (normalised): near texts share most of theirs."""
        codes, ql = _codes([query])
        q, _ = _trigrams(codes, ql)
        table = np.zeros(1 << TABLE_BITS, dtype=bool)
        table[q] = True
        hit = np.flatnonzero(table[self.hashes])
        rows = np.searchsorted(self.starts, hit, side="right") - 1
        shared = np.minimum(np.bincount(rows, minlength=len(self.texts)), len(q))
        return 2.0 * shared / np.maximum(self.n_trigrams + len(q), 1)

    def candidates(self, query: str, top: int = TOP, floor: float = DICE_FLOOR) -> np.ndarray:
        """The training prompts worth an exact ratio: the `top` of most shared trigrams and
        every one sharing at least `floor` of them."""
        d = self.dice(query)
        best = np.argpartition(-d, top)[:top] if len(d) > top else np.arange(len(d))
        return np.union1d(best, np.flatnonzero(d >= floor))

    def nearest(self, query: str, threshold: float = NEAR_COPY,
                max_near: int | None = None) -> Nearest:
        """The nearest training prompt to `query` by `similarity`, and every one above
        `threshold`, among the `candidates` (a ratio above 0.8 shares far more trigrams than
        DICE_FLOOR): exact ratios, computed in order of their upper bound until none left
        can beat the best or pass the threshold. max_near: stop after that many near-copies
        (a contaminated prompt can have thousands; its best is then the best of those)."""
        q = normalise(query)
        if not self.texts or not q:
            return Nearest(q, None, (), threshold)
        cand = self.candidates(q)
        bound = self.bounds(q)[cand]
        sm = SequenceMatcher(None, autojunk=False)
        sm.set_seq2(q)  # the query's index is built once
        best: Match | None = None
        near: list[Match] = []
        n = 0
        for j in np.argsort(-bound, kind="stable").tolist():
            b, i = float(bound[j]), int(cand[j])
            if b <= threshold and best is not None and b <= best.ratio:
                break
            sm.set_seq1(self.texts[i])
            if sm.real_quick_ratio() <= min(threshold, best.ratio if best else 0.0):
                continue
            r = sm.ratio()
            n += 1
            m = Match(r, self.texts[i], self.sources[i])
            if best is None or r > best.ratio:
                best = m
            if r > threshold:
                near.append(m)
                if max_near is not None and len(near) >= max_near:
                    break
        near.sort(key=lambda m: -m.ratio)
        return Nearest(q, best, tuple(near), threshold, n)

    def near_copy_of(self, training: str, threshold: float = NEAR_COPY) -> str | None:
        """For an index of HELD-OUT prompts: the one `training` (a training prompt) is a
        near-copy of (ratio above `threshold`, scored as `nearest` scores it), or None. The
        bounds rule out nearly every prompt at once: cheap enough for every prompt a
        dataset gets."""
        t = normalise(training)
        if not self.texts or not t:
            return None
        ok = (self.bounds(t) > threshold) & (self.dice(t) >= DICE_FLOOR)
        for i in np.flatnonzero(ok).tolist():
            sm = SequenceMatcher(None, t, self.texts[i], autojunk=False)
            if sm.real_quick_ratio() > threshold and sm.ratio() > threshold:
                return self.texts[i]
        return None


# -- answers: shared 8-grams --------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """Of an answer's `total` 8-grams (each counted once), `found` occur in the corpus; `best`
    of them occur in its single richest answer."""

    total: int
    found: int
    best: int

    def to_dict(self) -> dict:
        t = max(self.total, 1)
        return {"ngrams": self.total, "found": self.found,
                "share": round(self.found / t, 4) if self.total else 0.0,
                "best_answer_share": round(self.best / t, 4) if self.total else 0.0}


def corpus(answers: Iterable[Sequence[int]]) -> np.ndarray:
    """Answers concatenated with SEPARATOR between them (the answer store's layout)."""
    parts = [np.append(np.asarray(a, dtype=np.uint16), np.uint16(SEPARATOR))
             for a in answers if len(a)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _grams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    t = [int(x) for x in tokens]
    return list(dict.fromkeys(tuple(t[i:i + n]) for i in range(len(t) - n + 1)))


def _head_keys(toks: np.ndarray) -> np.ndarray:
    """[N] uint16 -> [N - 3] uint64: the four tokens from every position on, packed."""
    key = np.zeros(len(toks) - 3, dtype=np.uint64)
    for j in range(4):
        key = (key << np.uint64(16)) | toks[j:len(toks) - 3 + j].astype(np.uint64)
    return key


def ngram_shares(answers: Sequence[Sequence[int]], tokens: np.ndarray, n: int = NGRAM
                 ) -> list[Share]:
    """For each answer, how many of its distinct n-grams (n >= 4) occur in `tokens` (answers
    separated by SEPARATOR, as `corpus` writes them) and the most any one answer of it holds.
    One pass over the corpus for every answer at once."""
    if n < 4:
        raise ValueError("n-grams of at least 4 tokens")
    grams = [_grams(a, n) for a in answers]
    wanted = {g for gs in grams for g in gs}
    found: dict[tuple[int, ...], dict[int, None]] = {g: {} for g in wanted}
    toks = np.asarray(tokens, dtype=np.uint16)
    if wanted and len(toks) >= n:
        keys = np.unique(np.concatenate(
            [_head_keys(np.array(g[:4], dtype=np.uint16)) for g in wanted]))
        corpus_keys = _head_keys(toks)
        idx = np.minimum(np.searchsorted(keys, corpus_keys), len(keys) - 1)
        cand = np.flatnonzero(keys[idx] == corpus_keys)
        cand = cand[cand + n <= len(toks)]
        cuts = np.flatnonzero(toks == SEPARATOR)
        docs = np.searchsorted(cuts, cand)  # the answer each candidate position lies in
        for p, d in zip(cand.tolist(), docs.tolist()):
            g = tuple(int(x) for x in toks[p:p + n])
            if g in found:
                found[g][d] = None
    out = []
    for gs in grams:
        per_doc: dict[int, int] = {}
        hit = 0
        for g in gs:
            if found[g]:
                hit += 1
                for d in found[g]:
                    per_doc[d] = per_doc.get(d, 0) + 1
        out.append(Share(len(gs), hit, max(per_doc.values(), default=0)))
    return out
