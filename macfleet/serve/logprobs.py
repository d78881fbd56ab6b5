"""Log-probabilities of committed tokens, read from the verifier's own logits: each token's at
the row that decided it, so drafts never enter them (exact under speculation and batching up to
float noise); the model's distribution at temperature 1 before top_p (vLLM's raw logprobs).
docs/serving.md, "logprobs.py".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its log-probability and the `top` most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class LogprobsCommitted:
    """Engine event, emitted right before the TokensCommitted of the same tokens."""

    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class RowLogprobs:
    """Every row's log-probabilities of one verified block, built lazily (`row_logprobs`) and
    evaluated with the iteration's decisions; `entries` reads the committed tokens'."""

    lp: mx.array  # [L, V] float32
    idx: mx.array | None  # [L, top] each row's most likely ids (None: top 0)
    vals: mx.array | None  # [L, top] their log-probabilities

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.lp, self.idx, self.vals) if a is not None]

    def entries(self, rows: Sequence[int], tokens: Sequence[int]) -> tuple[TokenLogprob, ...]:
        """Evaluated: tokens[i] was decided at row rows[i]."""
        if len(rows) != len(tokens):
            raise ValueError(f"{len(rows)} rows for {len(tokens)} tokens")
        if not tokens:
            return ()
        lp = np.array(self.lp)
        top = self.idx is not None
        if top:
            idx_np, vals_np = np.array(self.idx), np.array(self.vals)
        out = []
        for r, t in zip(rows, tokens):
            alts: tuple[tuple[int, float], ...] = ()
            if top:
                order = np.lexsort((idx_np[r], -vals_np[r]))  # most likely first, ties by id
                alts = tuple((int(idx_np[r][j]), float(vals_np[r][j])) for j in order)
            out.append(TokenLogprob(int(t), float(lp[r, int(t)]), alts))
        return tuple(out)


def row_logprobs(logits: mx.array, top: int) -> RowLogprobs:
    """logits [L, V] -> every row's log-probabilities and `top` alternatives, lazy.
    top: alternatives per token (0..MAX_TOP_LOGPROBS; at most the vocabulary)."""
    sel = logits.astype(mx.float32)
    lp = sel - mx.logsumexp(sel, axis=-1, keepdims=True)
    top = max(0, min(top, lp.shape[-1]))
    if not top:
        return RowLogprobs(lp, None, None)
    idx = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
    return RowLogprobs(lp, idx, mx.take_along_axis(lp, idx, axis=-1))


def chain_rows(committed: int) -> list[int]:
    """A chain block [last, d1..dk] that committed d1..d(n) + next: rows 0..n."""
    return list(range(committed))


def tree_rows(path: Sequence[int], committed: int) -> list[int]:
    """A tree block that committed path tokens + next: each token at its parent's row (the root,
    then the path's nodes)."""
    return [0, *path][:committed]


# -- the API's shapes -----------------------------------------------------------------------
TokenText = Callable[[int], str]


def token_text(tokenizer) -> TokenText:
    """The text of one token alone (a memo over the tokenizer's decode)."""
    return functools.cache(lambda t: tokenizer.decode([t]))


def chat_content(entries: Sequence[TokenLogprob], text: TokenText) -> list[dict]:
    """Chat completions' `choices[].logprobs.content` (also a streamed chunk's)."""
    def one(t: int, lp: float) -> dict:
        s = text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, top: int,
                        offset: int = 0) -> dict:
    """Completions' `choices[].logprobs` ({tokens, token_logprobs, top_logprobs, text_offset});
    offset: the text already sent before these tokens (a streamed chunk's)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        s = text(e.token)
        tokens.append(s)
        offset += len(s)
    tops = [{text(t): lp for t, lp in e.top} for e in entries] if top else None
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": offsets}
