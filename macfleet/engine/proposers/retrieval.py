"""Retrieval drafts (REST, He et al. 2023): token trees of what followed the context's suffix in
a store of the verifier's own answers, looked up in an 8-token suffix array (docs/drafters.md,
"retrieval.py")."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from macfleet.engine.cachedir import cache_root
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer
from macfleet.engine.proposers.shipped import default_store_path
from macfleet.engine.tree_budget import TreeSizing

SEPARATOR = 0xFFFF  # between answers in the store (never a token id of a <65535 vocabulary)
NGRAMS = (8, 6, 4, 3, 2)
KEY_TOKENS = 4  # tokens packed into one 64-bit sort key (16 bits each)
DEFAULT_MAX_MATCHES = 64
DEFAULT_DEPTH = 8
DEFAULT_MAX_NODES = 24


def _pack(tokens: Sequence[int]) -> int:
    """Up to KEY_TOKENS token ids as the high bits of a 64-bit key (a Python int)."""
    key = 0
    for t in tokens:
        key = (key << 16) | int(t)
    return key << (16 * (KEY_TOKENS - len(tokens)))


def _keys(toks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) [N] uint64: the tokens at p..p+3 and p+4..p+7 of every position p, packed
    (past the end: SEPARATOR, which no context holds)."""
    n = len(toks)
    pad = np.concatenate([toks.astype(np.uint64),
                          np.full(2 * KEY_TOKENS, SEPARATOR, dtype=np.uint64)])
    hi, lo = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
    for j in range(KEY_TOKENS):
        hi = (hi << np.uint64(16)) | pad[j:j + n]
        lo = (lo << np.uint64(16)) | pad[KEY_TOKENS + j:KEY_TOKENS + j + n]
    return hi, lo


def _span(keys: np.ndarray, a: int, b: int, prefix: Sequence[int]) -> tuple[int, int]:
    """The range of sorted `keys[a:b]` whose packed tokens start with `prefix` (1-4 ids, each
    below SEPARATOR, so the next prefix's first key still fits in 64 bits)."""
    low = _pack(prefix)
    high = low + (1 << (16 * (KEY_TOKENS - len(prefix))))
    lo, hi = np.searchsorted(keys[a:b], np.array([low, high], np.uint64))
    return a + int(lo), a + int(hi)


INDEX_ARRAYS = ("order", "hi", "lo")
INDEX_FORMAT = 1


def _index_dir(toks: np.ndarray) -> Path:
    """The cache directory of the index of a store holding exactly `toks`."""
    digest = hashlib.sha1(toks.tobytes()).hexdigest()[:20]
    return cache_root() / "retrieval" / f"{digest}-v{INDEX_FORMAT}"


def _save_index(store: Datastore, where: Path) -> None:
    """Write the index whole or not at all; an unwritable cache only costs a rebuild later."""
    tmp = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=where.parent, prefix=".tmp-"))
        for name in INDEX_ARRAYS:
            np.save(tmp / f"{name}.npy", getattr(store, name))
        os.replace(tmp, where)
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class Datastore:
    """The answers, concatenated with separators, and their 8-token suffix array."""

    tokens: np.ndarray  # [N] uint16
    order: np.ndarray  # [N] int64: positions sorted by their next 8 tokens (then position)
    hi: np.ndarray  # [N] uint64: the first 4 of those tokens, packed, in `order`
    lo: np.ndarray  # [N] uint64: the next 4

    @classmethod
    def build(cls, answers: Sequence[Sequence[int]]) -> Datastore:
        parts = [np.append(np.asarray(a, dtype=np.uint16), np.uint16(SEPARATOR))
                 for a in answers if len(a)]
        toks = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
        return cls.from_tokens(toks)

    @classmethod
    def from_tokens(cls, toks: np.ndarray) -> Datastore:
        hi, lo = _keys(toks)
        order = np.lexsort((lo, hi))  # stable: equal keys stay in position order
        return cls(toks, order, hi[order], lo[order])

    @classmethod
    def load(cls, path: Path) -> Datastore:
        """A saved store, its index memory-mapped from this machine's cache when built here
        before, else built and cached (the sort takes seconds for the shipped store)."""
        toks = np.load(Path(path).with_suffix(".npy"))
        if toks.dtype != np.uint16 or toks.ndim != 1:
            raise ValueError(f"{path}: not a macfleet answer store (uint16 tokens)")
        where = _index_dir(toks)
        try:
            arrays = [np.load(where / f"{name}.npy", mmap_mode="r") for name in INDEX_ARRAYS]
            if all(a.shape == toks.shape for a in arrays):
                return cls(toks, *arrays)
        except (OSError, ValueError):
            pass  # not cached yet (or damaged): build it
        store = cls.from_tokens(toks)
        _save_index(store, where)
        return store

    def matches(self, context: Sequence[int], limit: int) -> list[tuple[int, int]]:
        """(position after the match, n) for up to `limit` occurrences of the context's
        suffix, longest n first; a larger range sampled evenly (each continuation keeps its
        share)."""
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n in NGRAMS:
            if len(context) < n or len(self.tokens) < n:
                continue
            suffix = [int(t) for t in context[-n:]]
            if not all(0 <= t < SEPARATOR for t in suffix):
                continue  # no answer of a uint16 store holds it
            a, b = _span(self.hi, 0, len(self.hi), suffix[:KEY_TOKENS])
            if n > KEY_TOKENS and b > a:
                a, b = _span(self.lo, a, b, suffix[KEY_TOKENS:])
            if b <= a:
                continue
            want = limit - len(out)
            picks = (np.arange(a, b) if b - a <= want
                     else a + (np.arange(want) * (b - a)) // want)
            for s in self.order[picks].tolist():
                after = s + n
                if after not in seen:
                    seen.add(after)
                    out.append((after, n))
            if len(out) >= limit:
                break
        return out[:limit]


def build_tree(store: Datastore, matches: Sequence[tuple[int, int]], depth: int
               ) -> tuple[list[int], list[int], list[float]]:
    """A weighted trie of the matches' continuations: (tokens, parents, weights), parents
    first; a node's weight is the share of matches that pass through it (longer matched
    suffixes count double: they are better evidence)."""
    tokens: list[int] = []
    parents: list[int] = []
    weight: list[float] = []
    child: dict[tuple[int, int], int] = {}
    total = sum(2.0 if n >= 4 else 1.0 for _, n in matches)
    for after, n in matches:
        w = (2.0 if n >= 4 else 1.0) / total
        cur = -1
        for t in store.tokens[after : after + depth].tolist():
            if t == SEPARATOR:
                break
            node = child.get((cur, t))
            if node is None:
                node = len(tokens)
                child[(cur, t)] = node
                tokens.append(t)
                parents.append(cur)
                weight.append(0.0)
            weight[node] += w
            cur = node
    return tokens, parents, weight


class RetrievalProposer(TreeSizing, Proposer):
    drafts_trees = True

    def __init__(self, store: Datastore, name: str = "retrieval") -> None:
        TreeSizing.__init__(self)
        self.store = store
        self.name = name

    def propose(self, context: Sequence[int], k: int) -> Draft:
        k = min(k, DEFAULT_MAX_NODES)
        if k <= 0:
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        matches = self.store.matches(context, DEFAULT_MAX_MATCHES)
        if not matches:
            return Draft((), None, (time.perf_counter() - t0) * 1e3)
        tokens, parents, weight = build_tree(self.store, matches, DEFAULT_DEPTH)
        order = sorted(range(len(tokens)), key=lambda i: (-weight[i], i))[:k]
        n = self.size([weight[i] for i in order], t0)
        keep = sorted(order[:n])  # trie order: parents come before children
        new = {old: j for j, old in enumerate(keep)}
        return Draft(tuple(tokens[i] for i in keep), None, (time.perf_counter() - t0) * 1e3,
                     tuple(new[parents[i]] if parents[i] >= 0 else -1 for i in keep))


_loaded: dict[str, tuple[Datastore, int]] = {}  # path -> (store, its largest token id)
_loading = threading.Lock()  # two sessions asking at once build it once


def _load(path: Path) -> tuple[Datastore, int]:
    """The store at `path` and its largest token id, built once per process."""
    key = str(path.with_suffix(".npy").resolve())
    with _loading:
        if key not in _loaded:
            store = Datastore.load(path)
            _loaded[key] = store, int(store.tokens[store.tokens != SEPARATOR].max(initial=0))
        return _loaded[key]


def warm_store(verifier_spec: str) -> bool:
    """Build the shipped store's index now (a proposer agent, before it advertises itself);
    False when none is shipped or it does not load (a request then gets the error)."""
    path = default_store_path(verifier_spec)
    if path is None or not path.with_suffix(".npy").is_file():
        return False
    try:
        _load(path)
    except (OSError, ValueError):
        return False
    return True


def make_retrieval_proposer(arg: str, verifier, error: type[Exception] = ValueError
                            ) -> RetrievalProposer:
    """`retrieval[:PATH]`: the answer store at PATH, or the one shipped for this verifier."""
    path = Path(arg).expanduser() if arg else default_store_path(verifier.spec)
    if path is None or not path.with_suffix(".npy").is_file():
        raise error(f"retrieval: no answer store for {verifier.spec}; build one with "
                    f"`macfleet distill --model {verifier.spec} --tokens N --store PATH`")
    try:
        store, largest = _load(path)
    except (OSError, ValueError) as e:
        raise error(f"retrieval: {e}") from e
    if store.tokens.size and largest >= verifier.vocab_size:
        raise error(f"retrieval: {path} holds token ids outside this verifier's vocabulary")
    return RetrievalProposer(store, name=f"retrieval:{arg}" if arg else "retrieval")
