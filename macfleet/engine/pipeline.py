"""The device-side halves of engine/block.py's decisions, so a block's one host synchronisation
carries two integers (accepted, next token) and the device never waits on Python. Greedy decides
bit for bit what the host rules do (tests/reference_rules.py); sampled acceptance the same rules
with Gumbel-max draws keyed by output position: equal in distribution. docs/engine.md, "Block
decisions on the device".
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.sampling import SamplingParams, device_probs, position_keys

SAMPLE, ACCEPT = 0, 1  # the two purposes a position's randomness serves (position_keys)
VERIFIER_STREAM = 0


def greedy_outcome(logits: mx.array, drafts: Sequence[int]) -> mx.array:
    """logits [L >= k + 1, V] of a block [root, d_1 .. d_k, padding...] -> lazy int32 [2]:
    (accepted n, next token), the verifier's argmax at row n. Row i scores the token after
    block input i, so draft d_{i+1} is accepted while it equals argmax row i."""
    k = len(drafts)
    target = mx.argmax(logits[: k + 1], axis=-1).astype(mx.int32)  # [k + 1]
    if k == 0:
        return mx.concatenate([mx.zeros((1,), dtype=mx.int32), target])
    match = (target[:k] == mx.array([int(t) for t in drafts], dtype=mx.int32)).astype(mx.int32)
    n = mx.cumprod(match).sum(keepdims=True)  # [1]: the leading run of matches
    return mx.concatenate([n, mx.take(target, n)])


def _leading_run(ok: mx.array) -> mx.array:
    """bool/int [k] -> [1] int32: how many leading entries are true."""
    return mx.cumprod(ok.astype(mx.int32)).sum(keepdims=True).astype(mx.int32)


def gumbel_pick(rows: mx.array, keys: mx.array, index: mx.array | None = None) -> mx.array:
    """rows [n, V] of non-negative weights (need not sum to 1) -> [n] int32, row i's token
    drawn with key i (with `index` [n]: key index[i]; rows sharing a key share its noise, drawn
    once): argmax(log w + Gumbel noise), an exact draw from the normalised row."""
    n = rows.shape[0] if index is None else keys.shape[0]
    noise = mx.stack([mx.random.gumbel(shape=(rows.shape[-1],), key=keys[i]) for i in range(n)])
    if index is not None:
        noise = noise[index]
    return mx.argmax(mx.log(rows) + noise, axis=-1).astype(mx.int32)


def rejection_rows(p: mx.array, q: mx.array) -> mx.array:
    """What a rejected draft's position samples from: max(p - q, 0) per row, p where that is
    zero everywhere (the measure-zero case; acceptance.residual on the host)."""
    r = mx.maximum(p - q, 0.0)
    return mx.where(r.sum(axis=-1, keepdims=True) > 0, r, p)


def sampled_outcome(logits: mx.array, drafts: Sequence[int], q: np.ndarray | None,
                    params: SamplingParams, seed: int, start: int) -> mx.array:
    """logits [L >= k + 1, V] of a block [root, d_1 .. d_k, padding...] -> lazy int32 [2]:
    (accepted n, next token), the sampled counterpart of `greedy_outcome`.

    `start` is the output position of the block's first new token: position start + i draws
    with keys (seed, start + i), so a plain step and a block commit position t alike.
    * q None (exact-match): y_i ~ p_i; draft i + 1 kept while it equals y_i; next = y_n.
    * q [k, V] (the ratio test): keep d_{i+1} while u_i * q_i(d) < p_i(d); on rejection at n
      draw from rejection_rows(p_n, q_n); after k acceptances draw the bonus from p_k."""
    k = len(drafts)
    p = device_probs(logits[: k + 1], params)  # [k + 1, V]
    sample_keys = position_keys(seed, VERIFIER_STREAM, start, k + 1, SAMPLE)
    if k == 0:
        return mx.concatenate([mx.zeros((1,), dtype=mx.int32), gumbel_pick(p, sample_keys)])
    d = mx.array([int(t) for t in drafts], dtype=mx.int32)
    if q is None:
        y = gumbel_pick(p, sample_keys)
        n = _leading_run(y[:k] == d)
        return mx.concatenate([n, mx.take(y, n)])
    qk = mx.array(np.asarray(q[:k], dtype=np.float32))
    accept_keys = position_keys(seed, VERIFIER_STREAM, start, k, ACCEPT)
    u = mx.stack([mx.random.uniform(key=accept_keys[i]) for i in range(k)])
    p_d = mx.take_along_axis(p[:k], d[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(qk, d[:, None], axis=-1)[:, 0]
    n = _leading_run((q_d > 0) & (u * q_d < p_d))
    rows = mx.concatenate([rejection_rows(p[:k], qk), p[k:]])
    return mx.concatenate([n, mx.take(gumbel_pick(rows, sample_keys), n)])


def sampled_tree_outcome(logits: mx.array, tokens: Sequence[int], parents: Sequence[int],
                         depths: Sequence[int], params: SamplingParams, seed: int,
                         start: int) -> mx.array:
    """logits [>= N, V] at a token tree's N nodes (node 0 the root; parents precede children;
    siblings' tokens distinct) -> lazy int32 [2]: (the deepest accepted node, 0 for none; the
    next token). engine/tree.py's exact-match rule: y ~ p at a node; follow the child whose
    token is y, else commit y. Every node draws with the key of its output position
    (start + depth): only one node per depth is ever on the walked path."""
    n = len(tokens)
    p = device_probs(logits[:n], params)
    keys = position_keys(seed, VERIFIER_STREAM, start, max(depths) + 1, SAMPLE)
    # one noise vector per depth (a tree of 33 nodes draws ~6, not 33: a CPU draws slowly)
    y = gumbel_pick(p, keys, mx.array(list(depths), dtype=mx.int32))  # [n]
    if n == 1:
        return mx.concatenate([mx.zeros((1,), dtype=mx.int32), y[:1]])
    toks = mx.array([int(t) for t in tokens[1:]], dtype=mx.int32)
    missed = (mx.take(y, mx.array([int(q) for q in parents[1:]], dtype=mx.int32)) != toks)
    # a node is reached when no node on its chain up to the root missed: ancestors [n-1, n-1]
    anc = np.zeros((n - 1, n - 1), dtype=np.float32)
    for i in range(1, n):
        j = i
        while j > 0:
            anc[i - 1, j - 1] = 1.0
            j = parents[j]
    reached = (mx.array(anc) @ missed.astype(mx.float32)) == 0  # [n - 1]
    depth = mx.array([int(d) for d in depths[1:]], dtype=mx.int32)
    score = mx.where(reached, depth, 0)
    node = mx.where(score.max() > 0, mx.argmax(score) + 1, 0).astype(mx.int32).reshape(1)
    return mx.concatenate([node, mx.take(y, node)])
