"""`macfleet bench data-curve`: how retrieval drafts scale with the verifier's own answers.

The distillation dataset (`macfleet distill --tokens N`) is the verifier's greedy answers, so
its held-out prompt groups (the same split as the head's figures, `distill.split_held_out`)
say exactly what a drafter would have had accepted on them: at each answer position, the
verifier's continuation IS the rest of the answer. This replays the retrieval drafter
(engine/proposers/retrieval.py: the same lookup and trie) against stores built from the first
1/8, 1/4, ... of the training answers and scores, per tree size N, the mean accepted tokens
per block (tau) a tree of the N most-weighted nodes would get. No verifier forward runs, so it
is cheap and exact for greedy decoding; it leaves out what the loop adds (the tree sizing
against verify(L), the n-gram lookup over the prompt), so it is an upper bound of the loop's tau
for a fixed N and a fair measure of how tau grows with data.

The fit tau = a + b * log2(store tokens) extrapolates to the store size a goal would need; a
log-linear fit of a few doublings is a rough guide, and is reported as one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from macfleet.engine.proposers.retrieval import (DEFAULT_DEPTH, DEFAULT_MAX_MATCHES, Datastore,
                                                 build_tree)

DEFAULT_NODES = (1, 4, 8, 16)
DEFAULT_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
DEFAULT_MAX_STARTS = 2000


@dataclass(frozen=True)
class Answer:
    """One sample of the dataset: its prompt group, prompt ids and the verifier's answer."""

    group: str
    prompt: np.ndarray  # [P] int64
    answer: np.ndarray  # [A] int64, the verifier's greedy tokens (final token included)


@dataclass(frozen=True)
class CurvePoint:
    store_tokens: int  # answer tokens in the store (separators excluded)
    starts: int  # held-out positions scored
    tau: dict[int, float]  # tree size N -> mean accepted tokens per block
    hit_rate: float  # share of positions where the lookup found any match


def read_answers(dataset: Path) -> list[Answer]:
    """Every sample of a dataset record (tokens, top, offsets, nprompt, meta groups); the
    hidden states are not needed."""
    from macfleet.distill.dataset import Manifest, _groups

    m = Manifest.read(dataset)
    out: list[Answer] = []
    for s in m.shards:
        toks = np.load(dataset / f"{s.name}.tokens.npy")
        top = np.load(dataset / f"{s.name}.top.npy")
        offs = np.load(dataset / f"{s.name}.offsets.npy")
        npr = np.load(dataset / f"{s.name}.nprompt.npy")
        groups = _groups(dataset / f"{s.name}.meta.jsonl", len(offs) - 1)
        for (a, b), n, g in zip(zip(offs[:-1].tolist(), offs[1:].tolist()), npr.tolist(),
                                groups):
            ans = np.concatenate([toks[a + n : b], top[b - 1 : b]]).astype(np.int64)
            out.append(Answer(g, toks[a : a + n].astype(np.int64), ans))
    return out


def split(answers: Sequence[Answer], share: float) -> tuple[list[Answer], list[Answer]]:
    """The head's held-out split (whole prompt groups by hash), applied to answers."""
    from macfleet.distill.pipeline import split_held_out

    class _C:  # split_held_out reads only .group
        def __init__(self, a: Answer) -> None:
            self.group, self.a = a.group, a

    train, held = split_held_out([_C(a) for a in answers], share)
    return [c.a for c in train], [c.a for c in held]


def accepted_in_tree(tokens: Sequence[int], parents: Sequence[int], keep: Sequence[int],
                     truth: Sequence[int]) -> int:
    """Longest root path among the kept nodes that the verifier's continuation follows (pure;
    `keep` is in trie order, so a node's parent precedes it)."""
    kept = set(keep)
    depth = {-1: 0}
    best = 0
    for i in keep:
        p = parents[i]
        if p != -1 and p not in kept:
            continue
        d = depth.get(p)
        if d is None or d >= len(truth) or tokens[i] != truth[d]:
            continue
        depth[i] = d + 1
        best = max(best, d + 1)
    return best


def score(store: Datastore, held: Sequence[Answer], nodes: Sequence[int], *,
          max_starts: int = DEFAULT_MAX_STARTS, depth: int = DEFAULT_DEPTH,
          max_matches: int = DEFAULT_MAX_MATCHES, seed: int = 0) -> CurvePoint:
    """tau of trees of each size in `nodes` at sampled answer positions of `held`."""
    starts = [(i, t) for i, a in enumerate(held) for t in range(1, len(a.answer) - 1)]
    rng = np.random.default_rng(seed)
    if len(starts) > max_starts:
        starts = [starts[j] for j in sorted(rng.choice(len(starts), max_starts, replace=False))]
    acc = {n: 0 for n in nodes}
    hits = 0
    for i, t in starts:
        a = held[i]
        ctx = np.concatenate([a.prompt, a.answer[:t]]).tolist()
        truth = a.answer[t : t + depth].tolist()
        matches = store.matches(ctx, max_matches)
        if not matches:
            continue
        hits += 1
        toks, parents, weight = build_tree(store, matches, depth)
        order = sorted(range(len(toks)), key=lambda j: (-weight[j], j))
        for n in nodes:
            acc[n] += accepted_in_tree(toks, parents, sorted(order[:n]), truth)
    k = max(len(starts), 1)
    return CurvePoint(store_tokens=0, starts=len(starts),
                      tau={n: acc[n] / k for n in nodes}, hit_rate=hits / k)


def fit_log2(points: Sequence[CurvePoint], n: int) -> tuple[float, float] | None:
    """Least squares tau = a + b * log2(store tokens) for tree size n; None if < 2 points."""
    return log2_fit([p.store_tokens for p in points], [p.tau[n] for p in points])


def log2_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares y = a + b * log2(x) over the points with x > 0 (pure): (a, b), b per
    doubling of x; None with fewer than two distinct x."""
    pts = [(math.log2(x), y) for x, y in zip(xs, ys) if x > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    b, a = np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)
    return float(a), float(b)


def tokens_for(goal: float, fit: tuple[float, float] | None) -> float | None:
    """x (store tokens, training tokens) at which the fitted line reaches `goal` (None: it
    never does)."""
    if fit is None or fit[1] <= 1e-9:  # flat (float noise of a flat fit included)
        return None
    try:
        return float(2 ** ((goal - fit[0]) / fit[1]))
    except OverflowError:  # beyond any float: never, for any purpose
        return None


def data_curve(dataset: Path, *, fractions: Sequence[float] = DEFAULT_FRACTIONS,
               nodes: Sequence[int] = DEFAULT_NODES, held_share: float | None = None,
               max_starts: int = DEFAULT_MAX_STARTS, goal: float = 2.5,
               progress=None) -> dict:
    """The curve over growing prefixes of the training answers (in generation order)."""
    from macfleet.distill.pipeline import HELD_OUT_SHARE

    answers = read_answers(dataset)
    train, held = split(answers, held_share or HELD_OUT_SHARE)
    points: list[CurvePoint] = []
    for f in fractions:
        part = train[: max(1, int(round(f * len(train))))]
        store = Datastore.build([a.answer for a in part])
        p = score(store, held, nodes, max_starts=max_starts)
        p = CurvePoint(int(sum(len(a.answer) for a in part)), p.starts, p.tau, p.hit_rate)
        points.append(p)
        if progress:
            progress(f"store {p.store_tokens:,} answer tokens: tau "
                     + ", ".join(f"N={n} {p.tau[n]:.2f}" for n in nodes)
                     + f" (lookup hits {p.hit_rate:.0%} of {p.starts} positions)")
    fits = {n: fit_log2(points, n) for n in nodes}
    return {
        "dataset": str(dataset),
        "train_answers": len(train), "held_out_answers": len(held),
        "held_out_groups": sorted({a.group for a in held})[:50],
        "method": "retrieval drafts (the shipped lookup and trie) replayed on held-out prompt "
                  "groups of the dataset; the verifier's greedy continuation is the answer "
                  "itself, so acceptance is exact for greedy; trees of the N most-weighted nodes",
        "points": [asdict(p) for p in points],
        "fit": {str(n): ({"a": f[0], "b_per_doubling": f[1]} if f else None)
                for n, f in fits.items()},
        "goal_tau": goal,
        "store_tokens_for_goal": {str(n): tokens_for(goal, f) for n, f in fits.items()},
    }


def plot(doc: dict, out: Path) -> Path | None:
    """tau against store tokens, one line per tree size (results/data_curve.png)."""
    from macfleet.bench.record import pyplot, save_log_x_plot

    plt = pyplot()
    if plt is None:
        return None
    pts = doc["points"]
    xs = [p["store_tokens"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in pts[0]["tau"]:
        ax.plot(xs, [p["tau"][n] for p in pts], "o-", label=f"retrieval tree of {n} nodes")
    ax.set_xscale("log")
    ax.set_xlabel("verifier answer tokens in the store")
    ax.set_ylabel("held-out tau (accepted tokens / block)")
    ax.set_title("retrieval drafts vs data (held-out prompt groups, greedy)", fontsize=9)
    return save_log_x_plot(plt, fig, ax, out)
