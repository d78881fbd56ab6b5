"""EAGLE-2 dynamic draft trees from one head (Li et al. 2024, "EAGLE-2").

Each block: the head predicts the feature after the context (the root); the `top_k` tokens
of its distribution become depth-1 nodes scored by log-probability. Then, depth by depth, the
`top_k` best frontier nodes (by cumulative log-probability) are expanded in ONE head forward
with tree attention (each node sees the committed pairs and its own ancestors, at position
base + depth - 1), each giving `top_k` children. Expansion stops at `max_depth` or when no
frontier node is likely enough to matter. Finally every node is re-ranked by cumulative
probability and the N best form the tree (ancestors always rank above their descendants, so
the selection is a tree); N comes from `choose_tree_size`: the head's confidence, calibrated
by what was accepted, against the verifier's measured verify(L).

Greedy verification keeps the longest path whose every token is the verifier's argmax:
bit-identical to the verifier alone. Under sampling the tree's tokens are a deterministic
function of the context (no draft probabilities), so the verifier samples its own token at
each node and follows a child only when it drew that child's token: every committed token is
a draw from the verifier's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.drafter.budget import Calibration, VerifyCurve, choose_tree_size
from macfleet.engine.drafter.head import EagleHead
from macfleet.engine.drafter.proposer import EagleProposer
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft
from macfleet.engine.tree_verify import tree_attention

DEFAULT_TOP_K = 4
DEFAULT_MAX_DEPTH = 6
DEFAULT_MAX_NODES = 24
DEFAULT_MIN_PROB = 0.02  # a frontier node less likely than this is not expanded


def head_tree_forward(head: EagleHead, feats: mx.array, tokens: mx.array, positions: mx.array,
                      mask: mx.array, cache: list) -> mx.array:
    """feats [n, H] (each node's input feature), tokens [n] -> predicted features [n, H];
    the nodes' keys/values are appended to the head's cache."""
    x = mx.concatenate([head.in_norm(feats[None]), head.embed(tokens[None])], axis=-1)
    h = head.fuse(x)
    for layer, c in zip(head.layers, cache):
        h = h + tree_attention(layer.self_attn, layer.input_layernorm(h), mask, c, positions)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h[0]


def _log_softmax(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


class EagleTreeProposer(EagleProposer):
    drafts_trees = True

    def __init__(self, head: EagleHead, name: str = "eagle2", *, top_k: int = DEFAULT_TOP_K,
                 max_depth: int = DEFAULT_MAX_DEPTH, max_nodes: int = DEFAULT_MAX_NODES,
                 min_prob: float = DEFAULT_MIN_PROB) -> None:
        super().__init__(head, name=name)
        self.top_k, self.max_depth, self.max_nodes = top_k, max_depth, max_nodes
        self.min_prob = min_prob
        self.curve = VerifyCurve()
        self.calibration = Calibration()
        self._predicted = 0.0  # sum of the last tree's node probabilities

    def _top(self, h: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """h [n, H] -> (token ids [n, top_k], log-probs [n, top_k]) of the head's best tokens."""
        lp = _log_softmax(self.head.draft_logits(h))
        idx = mx.argpartition(-lp, self.top_k - 1, axis=-1)[:, : self.top_k]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        ids = self.head.draft_ids
        toks = idx if ids is None else ids[idx]
        mx.eval(toks, vals)
        return np.array(toks).astype(np.int64), np.array(vals).astype(np.float64)

    def propose(self, context: Sequence[int], k: int, with_guess: bool = False) -> Draft:
        k = min(k, self.max_nodes)
        if k <= 0 or len(context) < 2:
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        context = [int(t) for t in context]
        root = self._root(context)[0]  # [1, H]
        base = int(self._head_cache[0].offset)
        # node arrays (drafted nodes only; parent -1 = the root)
        tokens: list[int] = []
        parents: list[int] = []
        depth: list[int] = []
        score: list[float] = []
        src: list[int] = []  # node -> row in `feats` of the feature that predicted it
        feats: list[mx.array] = [root]  # row 0: the root's predicted feature
        slot_of: dict[int, int] = {}  # expanded node -> its slot in the head cache
        toks, lps = self._top(root)
        for t, lp in zip(toks[0], lps[0]):
            tokens.append(int(t)); parents.append(-1); depth.append(1)
            score.append(float(lp)); src.append(0)
        frontier = list(range(len(tokens)))
        gain = self.calibration.gain
        for d in range(2, self.max_depth + 1):
            beam = sorted(frontier, key=lambda i: -score[i])[: self.top_k]
            beam = [i for i in beam if gain * np.exp(score[i]) >= self.min_prob]
            if not beam:
                break
            n_slots = len(slot_of)
            for i in beam:
                slot_of[i] = n_slots + beam.index(i)
            mask = np.zeros((len(beam), base + len(slot_of)), dtype=bool)
            mask[:, :base] = True
            for r, i in enumerate(beam):
                j = i
                while j >= 0:  # the node and its ancestors (all of them expanded already)
                    mask[r, base + slot_of[j]] = True
                    j = parents[j]
            x = mx.concatenate([feats[src[i]] for i in beam], axis=0)
            h = head_tree_forward(self.head, x, mx.array([tokens[i] for i in beam],
                                                          dtype=mx.uint32),
                                  mx.array([base + depth[i] - 1 for i in beam], dtype=mx.int32),
                                  mx.array(mask), self._head_cache)
            ctoks, clps = self._top(h)
            frontier = []
            for r, i in enumerate(beam):
                feats.append(h[r : r + 1])
                row = len(feats) - 1
                for t, lp in zip(ctoks[r], clps[r]):
                    tokens.append(int(t)); parents.append(i); depth.append(d)
                    score.append(score[i] + float(lp)); src.append(row)
                    frontier.append(len(tokens) - 1)
        if slot_of:
            for c in self._head_cache:
                c.trim(len(slot_of))
        order = sorted(range(len(tokens)), key=lambda i: (-score[i], depth[i], i))
        probs = [float(np.exp(score[i])) for i in order[:k]]
        n = choose_tree_size(probs, self.curve.costs(len(probs)), self.calibration.gain)
        keep = sorted(order[:n], key=lambda i: (depth[i], i))
        new_index = {old: j for j, old in enumerate(keep)}
        self._predicted = sum(probs[:n])
        draft_ms = (time.perf_counter() - t0) * 1e3
        if not keep:
            return Draft((), None, draft_ms)
        return Draft(tuple(tokens[i] for i in keep), None, draft_ms, None,
                     tuple(new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep))

    def observe(self, drafted: int, accepted: int, verify_ms: float) -> None:
        self.curve.observe(drafted + 1, verify_ms)
        if drafted:
            self.calibration.observe(self._predicted, accepted)
