"""Token trees: several proposers' drafts merged and accepted in one verifier forward.

Pure data and decisions, no MLX. Node 0 is the root (the last committed token); every other
node's parent precedes it, so a block in node order is verified in ONE forward with an ancestor
mask and per-node positions. Acceptance walks from the root: greedy (the argmax child),
exact-match sampling, or SpecInfer's rule with draft probabilities; each is lossless, why:
docs/engine.md, "Token trees".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from macfleet.engine.sampling import sample


@dataclass(frozen=True)
class Candidate:
    """A child of a node as drafted by one proposer (with the q row it was sampled from)."""

    node: int
    source: int  # proposer index
    q: np.ndarray | None = field(default=None, compare=False)


@dataclass
class TokenTree:
    tokens: list[int]  # node -> token (node 0: the root)
    parents: list[int]  # node -> parent (-1 for the root)
    depths: list[int]
    children: list[dict[int, int]]  # node -> {token: child node}
    candidates: list[list[Candidate]]  # node -> candidates in proposer order
    paths: list[list[int]]  # root-to-leaf chains of nodes (one per chain draft, one per leaf
    #                        of a tree draft), in proposer order
    owned: list[set[int]] = field(default_factory=list)  # proposer -> the nodes it drafted

    @property
    def size(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.tokens) - 1

    def _child(self, cur: int, tok: int) -> int:
        child = self.children[cur].get(tok)
        if child is None:
            child = len(self.tokens)
            self.tokens.append(tok)
            self.parents.append(cur)
            self.depths.append(self.depths[cur] + 1)
            self.children.append({})
            self.candidates.append([])
            self.children[cur][tok] = child
        return child

    @classmethod
    def from_drafts(cls, root: int, drafts: Sequence[Sequence[int]],
                    probs: Sequence[np.ndarray | None] | None = None,
                    parents: Sequence[Sequence[int] | None] | None = None) -> TokenTree:
        """Merge drafts sharing prefixes. probs[j]: [len(drafts[j]), V] or None.

        parents[j], when given, makes draft j a tree: token i hangs under token parents[j][i]
        of the same draft (-1: under the root). Chains and trees merge alike."""
        t = cls([int(root)], [-1], [0], [{}], [[]], [])
        for j, toks in enumerate(drafts):
            q = probs[j] if probs is not None else None
            par = parents[j] if parents is not None else None
            chain = par is None
            if chain:
                par = list(range(-1, len(toks) - 1))
            nodes: list[int] = []
            for d, (tok, p) in enumerate(zip(toks, par)):
                cur = 0 if p < 0 else nodes[p]
                child = t._child(cur, int(tok))
                t.candidates[cur].append(Candidate(child, j, None if q is None else q[d]))
                nodes.append(child)
            t.owned.append(set(nodes))
            if chain:  # exactly one path per chain draft, even an empty one
                t.paths.append(nodes)
                continue
            leaves = set(range(len(nodes))) - {p for p in par if p >= 0}
            for leaf in sorted(leaves):
                branch, i = [], leaf
                while i >= 0:
                    branch.append(nodes[i])
                    i = par[i]
                t.paths.append(branch[::-1])
        return t

    def first(self, n: int) -> TokenTree:
        """The tree of nodes 0..n-1, for a block cut to n tokens (parents precede children)."""
        if n >= len(self.tokens):
            return self
        if n < 1:
            raise ValueError("a tree keeps at least its root")
        return TokenTree(self.tokens[:n], self.parents[:n], self.depths[:n],
                         [{t: c for t, c in ch.items() if c < n} for ch in self.children[:n]],
                         [[c for c in cs if c.node < n] for cs in self.candidates[:n]],
                         [[i for i in p if i < n] for p in self.paths],
                         [{i for i in o if i < n} for o in self.owned])

    def keep(self, nodes: Sequence[int], probs: bool = True) -> TokenTree:
        """The tree of `nodes` (the root always; a node whose parent is left out goes too),
        renumbered in their order; candidates and ownership follow their nodes, one path per
        leaf. probs=False drops the drafts' probabilities (exact-match acceptance then)."""
        want, new_of, entries = set(nodes), {0: 0}, []
        for i in range(1, len(self.tokens)):
            if i in want and self.parents[i] in new_of:
                new_of[i] = len(entries) + 1
                entries.append((self.tokens[i], new_of[self.parents[i]], i))
        return self._rebuild(entries, probs)

    def _rebuild(self, entries: Sequence[tuple[int, int, int | None]],
                 probs: bool = True) -> TokenTree:
        """A tree under the same root from entries[k] = (token, parent's new index, the node
        of this tree new node k + 1 stands for, or None): candidates and ownership carried
        over where both ends stand for nodes of this tree (a node with no candidate gets
        one of no proposer, source -1); one path per leaf."""
        t = TokenTree([self.tokens[0]], [-1], [0], [{}], [[]], [], [set() for _ in self.owned])
        new_of = {0: 0}
        for tok, parent, old in entries:
            child = t._child(parent, int(tok))
            if old is not None:
                new_of[old] = child
        for old_parent, cands in enumerate(self.candidates):
            for c in cands:
                p, n = new_of.get(old_parent), new_of.get(c.node)
                if p is not None and n is not None and t.parents[n] == p:
                    t.candidates[p].append(Candidate(n, c.source, c.q if probs else None))
        for child in range(1, len(t.tokens)):
            p = t.parents[child]
            if all(c.node != child for c in t.candidates[p]):
                t.candidates[p].append(Candidate(child, -1))
        t.owned = [{new_of[i] for i in nodes if i in new_of} for nodes in self.owned]
        for leaf in range(1, len(t.tokens)):
            if not t.children[leaf]:
                t.paths.append(nodes_to(t.parents, leaf))
        return t

    def path_tokens(self, path: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in path]

    def accepted_per_source(self, path: Sequence[int]) -> list[int]:
        """How many of each proposer's draft tokens lie on the accepted path."""
        on = set(path)
        return [len(on & nodes) for nodes in self.owned]


def graft(tree: TokenTree, forced: Sequence[int]) -> TokenTree:
    """`forced` tokens (a grammar's: the only ones it allows next) as a chain from the root,
    then what the drafts put under the node the same tokens lead to in `tree` (nothing when
    the drafts did not draft all of them): a draft that agrees with the forced tokens keeps
    what it drafted past them, as `constraint.constrained_draft` does for a chain."""
    if not forced:
        return tree
    entries: list[tuple[int, int, int | None]] = []
    old: int | None = 0
    for k, tok in enumerate(forced):
        old = tree.children[old].get(int(tok)) if old is not None else None
        entries.append((int(tok), k, old))
    if old is not None:
        new_of = {old: len(entries)}
        for i in range(old + 1, len(tree.tokens)):
            if tree.parents[i] in new_of:
                new_of[i] = len(entries) + 1
                entries.append((tree.tokens[i], new_of[tree.parents[i]], i))
    return tree._rebuild(entries)


def nodes_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (none for the root)."""
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[L, L] bool for nodes whose parents precede them (-1: none): node i may attend to
    node j (j is i or an ancestor of i). A chain (parents i-1) gives the causal mask."""
    n = len(parents)
    m = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def depths_of(parents: Sequence[int]) -> list[int]:
    """Each node's depth (a node without parent: 0)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def reroot(tokens: Sequence[int], parents: Sequence[int] | None, first: int
           ) -> tuple[list[int], list[int], list[int]]:
    """A draft made one token early (its top-level nodes guess the token after the context),
    cut to the subtree under the first top-level node whose token is `first`, as a draft
    from the context + `first`: (kept tokens, their parents re-indexed, kept source indices).
    A chain (parents None) is the tree i -> i - 1. Nothing kept when no guess was `first`."""
    par = list(parents) if parents is not None else list(range(-1, len(tokens) - 1))
    top = next((i for i, (t, p) in enumerate(zip(tokens, par)) if p < 0 and int(t) == first),
               None)
    if top is None:
        return [], [], []
    new_index = {top: -1}
    kept_t: list[int] = []
    kept_p: list[int] = []
    kept_i: list[int] = []
    for i in range(top + 1, len(tokens)):
        if par[i] in new_index:
            new_index[i] = len(kept_t)
            kept_t.append(int(tokens[i]))
            kept_p.append(new_index[par[i]])
            kept_i.append(i)
    return kept_t, kept_p, kept_i


def longest_branch(parents: Sequence[int]) -> list[int]:
    """The nodes of a draft's first deepest root-to-leaf branch (a chain: all of it)."""
    depths = depths_of(parents)
    if not depths:
        return []
    i = depths.index(max(depths))
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def accept_tree_greedy(tree: TokenTree, target_ids: Sequence[int]) -> tuple[list[int], int]:
    """target_ids: argmax at every node. Returns (accepted node path, next token)."""
    cur, path = 0, []
    while True:
        t = int(target_ids[cur])
        child = tree.children[cur].get(t)
        if child is None:
            return path, t
        path.append(child)
        cur = child


def accept_tree_sample(tree: TokenTree, p: np.ndarray,
                       rng: np.random.Generator) -> tuple[list[int], int]:
    """p: [N+1, V] verifier probabilities at every node."""
    cur, path = 0, []
    while True:
        cands = tree.candidates[cur]
        if not cands:
            return path, sample(p[cur], rng)
        if all(c.q is not None for c in cands):
            nxt, tok = _multi_step(tree, cands, p[cur], rng)
        else:
            tok = sample(p[cur], rng)
            nxt = tree.children[cur].get(tok)
        if nxt is None:
            return path, tok
        path.append(nxt)
        cur = nxt


def residual(p_row: np.ndarray, q_row: np.ndarray) -> np.ndarray:
    """Normalised max(p - q, 0); falls back to p when p <= q everywhere (measure-zero case)."""
    r = np.maximum(p_row - q_row, 0.0)
    s = r.sum()
    return r / s if s > 0 else p_row


def _multi_step(tree: TokenTree, cands: list[Candidate], p_row: np.ndarray,
                rng: np.random.Generator) -> tuple[int | None, int]:
    p = p_row
    for c in cands:
        x = tree.tokens[c.node]
        qx = float(c.q[x])
        if qx > 0 and rng.random() < min(1.0, p[x] / qx):
            return c.node, x
        p = residual(p, c.q)
    return None, sample(p, rng)
