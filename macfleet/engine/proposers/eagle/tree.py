"""EAGLE-2 dynamic draft trees (Li et al. 2024): a fixed beam expanded depth by depth while a
level pays, the N best nodes by cumulative probability kept, N sized against the verifier's
verify(L) (docs/drafters.md, "eagle/tree.py")."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft
from macfleet.engine.proposers.eagle.chain import EagleProposer
from macfleet.engine.proposers.eagle.head import EagleHead
from macfleet.engine.tree_budget import Backoff, TreeSizing, worth_expanding
from macfleet.engine.tree_verify import tree_attention

DEFAULT_TOP_K = 4
DEFAULT_MAX_DEPTH = 5
MAX_NODES = 24
MIN_PROB = 0.02  # a head less sure than this of the first token drafts no deeper level
# levels below the first draft from the head's this many most frequent draft ids (a head saved
# with draft order "frequency"): a level then fits a CPU's L3 (docs/benchmarks.md, Drafters)
DEFAULT_DEEP_VOCAB = 4096


@dataclass(frozen=True)
class TreeCandidates:
    """The nodes a head drafted for one block, in drafting order: token, cumulative
    log-probability, parent index (-1: the root) and depth (1 = the first draft)."""

    tokens: tuple[int, ...]
    scores: tuple[float, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]

    def ranked(self) -> list[int]:
        """Node indices best first: by cumulative probability, then shallower, then earlier
        (an ancestor always ranks above its descendants, so every prefix is a tree)."""
        return sorted(range(len(self.tokens)),
                      key=lambda i: (-self.scores[i], self.depths[i], i))

    def best(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The tree of the n best nodes: (tokens, parents) ordered by depth, parents indexing
        into it (-1: the root)."""
        keep = sorted(self.ranked()[:n], key=lambda i: (self.depths[i], i))
        new_index = {old: j for j, old in enumerate(keep)}
        return (tuple(self.tokens[i] for i in keep),
                tuple(new_index[self.parents[i]] if self.parents[i] >= 0 else -1
                      for i in keep))


def head_tree_forward(head: EagleHead, feats: mx.array, tokens: mx.array, positions: mx.array,
                      mask: mx.array, cache: list) -> mx.array:
    """feats [n, H] (each node's input feature), tokens [n] -> predicted features [n, H];
    the nodes' keys/values are appended to the head's cache."""
    h = head.inputs(feats[None], tokens[None])
    for layer, c in zip(head.layers, cache):
        h = h + tree_attention(layer.self_attn, layer.input_layernorm(h), mask, c, positions)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h[0]


class EagleTreeProposer(TreeSizing, EagleProposer):
    drafts_trees = True

    def __init__(self, head: EagleHead, name: str = "eagle2", *, top_k: int = DEFAULT_TOP_K,
                 max_depth: int = DEFAULT_MAX_DEPTH, deep_vocab: int = DEFAULT_DEEP_VOCAB) -> None:
        EagleProposer.__init__(self, head, name=name)
        TreeSizing.__init__(self)
        self.top_k, self.max_depth = top_k, max_depth
        self.deep_vocab = deep_vocab  # 0: every level drafts from the whole draft vocabulary
        self.backoff = Backoff()
        self.depth_ms = 0.0  # measured cost of one deeper level (EMA)

    def _top(self, h: mx.array, limit: int = 0) -> tuple[mx.array, mx.array]:
        """h [n, H] -> lazy (token ids, log-probs) [n, top_k] of the head's best tokens; limit:
        from the first `limit` draft ids only (`EagleHead.draft_logits`)."""
        logits = self.head.draft_logits(h, limit).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        idx = mx.argpartition(-lp, self.top_k - 1, axis=-1)[:, : self.top_k]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        ids = self.head.draft_ids
        return (idx if ids is None else ids[idx]), vals

    def _expand(self, root: mx.array, t1: mx.array, s1: mx.array, base: int
                ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """Depths 2.. one head forward each (the beam: the top_k best nodes of the newest depth),
        while `worth_expanding` says a level pays. Per level: candidate tokens [K*K], their
        cumulative scores [K*K], and each beam node's candidate index in the level below."""
        K = self.top_k
        toks, scores, sel = [], [], []
        beam_tok, beam_score = t1, s1  # depth-1 nodes: all K are the first beam
        beam_feat = mx.repeat(root, K, axis=0)  # [K, H]: the feature that predicted each node
        beam_sel = mx.arange(K)
        anc = mx.eye(K, dtype=mx.bool_)  # beam node x expanded slot: its ancestors and itself
        step_ms = self.curve.costs(0)[0] if self.curve.samples else None
        for d in range(2, self.max_depth + 1):
            if step_ms is not None and not worth_expanding(
                    np.exp(np.array(beam_score, dtype=np.float64)), self.calibration.gain,
                    self.depth_ms, step_ms):
                break
            t0 = time.perf_counter()
            mask = mx.concatenate([mx.ones((K, base), dtype=mx.bool_), anc], axis=1)
            pos = mx.full((K,), base + d - 2, dtype=mx.int32)
            h = head_tree_forward(self.head, beam_feat, beam_tok.astype(mx.uint32), pos, mask,
                                  self._head_cache)  # [K, H]
            ct, cs = self._top(h, self.deep_vocab)  # [K, K]
            flat_s = (beam_score[:, None] + cs).reshape(-1)
            flat_t = ct.reshape(-1)
            nxt = mx.argpartition(-flat_s, K - 1)[:K]  # the next beam: best K of this depth
            mx.eval(flat_t, flat_s, nxt, h)
            toks.append(np.array(flat_t))
            scores.append(np.array(flat_s))
            sel.append(np.array(beam_sel))
            self.depth_ms = (self.depth_ms * 0.8 + 0.2 * (time.perf_counter() - t0) * 1e3
                             if self.depth_ms else (time.perf_counter() - t0) * 1e3)
            pb = nxt // K
            beam_tok, beam_score, beam_feat, beam_sel = flat_t[nxt], flat_s[nxt], h[pb], nxt
            anc = mx.concatenate([anc[pb], mx.eye(K, dtype=mx.bool_)], axis=1)
        return toks, scores, sel

    def candidates(self, context: Sequence[int]) -> TreeCandidates:
        """Every node the head drafts after `context`; the head's cache is left at it."""
        context = [int(t) for t in context]
        root = self._root(context)[0]  # [1, H]
        base = int(self._head_cache[0].offset)
        K = self.top_k
        t1, s1 = self._top(root)
        mx.eval(t1, s1)
        tokens = np.array(t1[0]).astype(np.int64).tolist()
        score = np.array(s1[0]).astype(np.float64).tolist()
        parents = [-1] * K
        depth = [1] * K
        # a head this unsure of the next token will not get deeper ones right: stop here
        if self.max_depth > 1 and self.calibration.gain * np.exp(max(score)) >= MIN_PROB:
            toks, scores, sel = self._expand(root, t1[0], s1[0], base)
            prev = 0  # the node id of the level above's first candidate
            for lvl, (lt, ls, lsel) in enumerate(zip(toks, scores, sel), start=2):
                first = len(tokens)
                tokens += np.array(lt).astype(np.int64).tolist()
                score += np.array(ls).astype(np.float64).tolist()
                parents += [prev + int(lsel[c // K]) for c in range(K * K)]
                depth += [lvl] * (K * K)
                prev = first
            if toks:
                for c in self._head_cache:
                    c.trim(len(toks) * K)
        return TreeCandidates(tuple(tokens), tuple(score), tuple(parents), tuple(depth))

    def propose(self, context: Sequence[int], k: int) -> Draft:
        k = min(k, MAX_NODES)
        if k <= 0 or len(context) < 2 or not self.backoff.should_draft():
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        cand = self.candidates(context)
        order = cand.ranked()
        probs = [float(np.exp(cand.scores[i])) for i in order[:k]]
        n = self.size(probs, t0)  # none when no tree beats plain decoding (then the backoff)
        draft_ms = (time.perf_counter() - t0) * 1e3
        tokens, parents = cand.best(n)
        return Draft(tokens, None, draft_ms, parents if tokens else None)

    def observe(self, drafted: int, accepted: int, verify_ms: float,
                verified: int | None = None) -> None:
        TreeSizing.observe(self, drafted, accepted, verify_ms, verified)
        self.backoff.observe(drafted, accepted)
