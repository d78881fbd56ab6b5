"""The verifier's own greedy answers, many at once, with its hidden states captured on the way.

One forward serves a whole batch of rows (decode is bandwidth-bound: 16 rows cost ~2x one
row here), rows are ragged (left-padded, mlx-lm's `BatchKVCache`), each row stops on its own
EOS or length, and finished rows are replaced by new prompts between steps (continuous
refill), so the batch stays full. The layers are run here rather than through the model's
`__call__` so the last layer's pre-norm output -- the feature the draft head learns from --
is kept for every position at no extra cost: no second pass over the data to extract
features. Prompt positions get their features from the prefill and, as their target, the
verifier's own argmax; answer positions get the token the verifier chose next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from macfleet.distill.prompts import Prompt
from macfleet.engine.layers import head_logits, run_layers
from macfleet.engine.models import LoadedModel
from macfleet.engine.text import encode_prompt

DEFAULT_BATCH = 32
DEFAULT_MAX_ANSWER = 256
MAX_PROMPT_TOKENS = 512  # longer prompts are skipped: they would dominate the batch's KV


@dataclass(frozen=True)
class Sample:
    """One prompt and the verifier's greedy answer, as the verifier saw it."""

    prompt: Prompt
    tokens: np.ndarray  # [T] int32: every token fed (prompt + answer except its last token)
    hidden: np.ndarray  # [T, H] float16: last layer, pre-norm, at each fed position
    top: np.ndarray  # [T] int32: the verifier's greedy next token after each position
    n_prompt: int
    finish: str  # "stop" (EOS) or "length"

    @property
    def answer_tokens(self) -> int:
        return len(self.tokens) - self.n_prompt + 1


@dataclass
class Timing:
    """Where generation time goes (seconds)."""

    encode: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    copy: float = 0.0  # device -> host of features and tokens
    steps: int = 0
    rows: int = 0  # sum of active rows over decode steps (mean batch = rows / steps)

    def to_dict(self) -> dict[str, float]:
        return {"encode_s": self.encode, "prefill_s": self.prefill, "decode_s": self.decode,
                "copy_s": self.copy, "decode_steps": self.steps,
                "mean_batch": self.rows / self.steps if self.steps else 0.0}


@dataclass
class _Row:
    prompt: Prompt
    ids: list[int]
    hidden: list[np.ndarray] = field(default_factory=list)
    top: list[np.ndarray] = field(default_factory=list)
    answer: list[int] = field(default_factory=list)


def _take(lm: LoadedModel, src: Iterator[Prompt], k: int, timing: Timing) -> list[_Row]:
    """Up to k rows of encoded prompts (prompts over MAX_PROMPT_TOKENS are skipped)."""
    out: list[_Row] = []
    t0 = time.perf_counter()
    while len(out) < k:
        p = next(src, None)
        if p is None:
            break
        ids = encode_prompt(lm.tokenizer, p.chat_input, chat=True)
        if len(ids) <= MAX_PROMPT_TOKENS:
            out.append(_Row(p, list(ids)))
    timing.encode += time.perf_counter() - t0
    return out


def _forward(lm: LoadedModel, x: mx.array, cache: list) -> tuple[mx.array, mx.array]:
    """x [B, L] -> (pre-norm hidden [B, L, H], argmax [B, L])."""
    inner = lm.model.model
    h = run_layers(inner.layers, inner.embed_tokens(x), cache)
    return h, mx.argmax(head_logits(lm.model, h), axis=-1)


def _prefill(lm: LoadedModel, rows: Sequence[_Row]) -> tuple[list, list[np.ndarray],
                                                            list[np.ndarray]]:
    """A left-padded batch cache holding the rows' prompts, with their hidden and argmax.

    Each prompt is prefilled alone (a prompt is already a matmul-sized block, and padding a
    wave to its longest prompt wasted most of the compute), then the caches are merged."""
    per_layer: list[list[KVCache]] = [[] for _ in lm.model.layers]
    hs, tops = [], []
    for r in rows:
        cache = [KVCache() for _ in lm.model.layers]
        h, top = _forward(lm, mx.array(r.ids, dtype=mx.uint32)[None], cache)
        mx.eval(h, top, [c.state for c in cache])
        hs.append(np.array(h[0].astype(mx.float16)))
        tops.append(np.array(top[0]).astype(np.int32))
        for acc, c in zip(per_layer, cache):
            acc.append(c)
    return [BatchKVCache.merge(cs) for cs in per_layer], hs, tops


def generate_samples(lm: LoadedModel, prompts: Iterable[Prompt], *,
                     batch: int = DEFAULT_BATCH, max_answer: int = DEFAULT_MAX_ANSWER,
                     timing: Timing | None = None,
                     on_step: Callable[[int], None] | None = None) -> Iterator[Sample]:
    """Greedy answers to `prompts`, `batch` rows at a time, yielded as each finishes."""
    timing = timing if timing is not None else Timing()
    eos = lm.eos_ids
    src = iter(prompts)
    rows: list[_Row] = []
    cache: list | None = None

    def take(k: int) -> list[_Row]:
        return _take(lm, src, k, timing)

    while True:
        if len(rows) <= batch // 2:  # refill between steps: keep the batch full
            new = take(batch - len(rows))
            if new:
                t0 = time.perf_counter()
                c2, hs, tops = _prefill(lm, new)
                timing.prefill += time.perf_counter() - t0
                for r, h, top in zip(new, hs, tops):
                    r.hidden.append(h)
                    r.top.append(top)
                    r.answer.append(int(top[-1]))
                if cache is None:
                    cache = c2
                else:
                    for a, b in zip(cache, c2):
                        a.extend(b)
                rows.extend(new)
        if not rows:
            return
        # a row whose newest token is EOS (or its last allowed one) is done: never fed
        done = {i for i, r in enumerate(rows)
                if r.answer[-1] in eos or len(r.answer) >= max_answer}
        if done:
            for i in sorted(done):
                yield _finish(rows[i], eos)
            keep = [i for i in range(len(rows)) if i not in done]
            rows = [rows[i] for i in keep]
            if not rows:
                cache = None
                continue
            idx = mx.array(keep, dtype=mx.int32)
            for c in cache:
                c.filter(idx)
            if len(rows) <= batch // 2:
                continue  # refill before the next step
        _decode_step(lm, rows, cache, timing, on_step)


def _decode_step(lm: LoadedModel, rows: Sequence[_Row], cache: list, timing: Timing,
                 on_step: Callable[[int], None] | None,
                 stopped: Callable[[_Row], bool] = lambda r: False) -> None:
    """One decode forward over every row: each row not `stopped` takes its greedy token and
    the hidden state of the position it fed."""
    t0 = time.perf_counter()
    x = mx.array([[r.answer[-1]] for r in rows], dtype=mx.uint32)
    h, top = _forward(lm, x, cache)
    mx.eval(h, top)
    t1 = time.perf_counter()
    hn, tn = np.array(h[:, 0].astype(mx.float16)), np.array(top[:, 0]).astype(np.int32)
    for i, r in enumerate(rows):
        if not stopped(r):
            r.hidden.append(hn[i : i + 1])
            r.top.append(tn[i : i + 1])
            r.answer.append(int(tn[i]))
    timing.copy += time.perf_counter() - t1
    timing.decode += t1 - t0
    timing.steps += 1
    timing.rows += len(rows)
    if on_step is not None:
        on_step(len(rows))


def _finish(r: _Row, eos: frozenset[int]) -> Sample:
    fed = r.ids + r.answer[:-1]
    hidden = np.concatenate(r.hidden)[: len(fed)]
    top = np.concatenate(r.top)[: len(fed)]
    return Sample(prompt=r.prompt, tokens=np.array(fed, dtype=np.int32), hidden=hidden, top=top,
                  n_prompt=len(r.ids), finish="stop" if r.answer[-1] in eos else "length")


DEFAULT_WAVE_POOL = 4  # waves' worth of prompts sorted by length together


def generate_waves(lm: LoadedModel, prompts: Iterable[Prompt], *,
                   batch: int = DEFAULT_BATCH, max_answer: int = DEFAULT_MAX_ANSWER,
                   timing: Timing | None = None,
                   on_step: Callable[[int], None] | None = None,
                   pool: int = DEFAULT_WAVE_POOL) -> Iterator[Sample]:
    """Greedy answers like `generate_samples`, a fixed wave of `batch` rows at a time.

    A wave is prefilled in ONE forward (prompts of similar length, sorted, left-padded in one
    batch cache) and decoded until every row has stopped; rows are never swapped in or out,
    so each step is one forward and one copy. Rows that stopped early still ride along (their
    tokens are cut at EOS): on an accelerator, where a step costs about the same at any batch,
    that waste is far cheaper than the continuous refill's per-prompt prefills and cache
    merges (MLX's CUDA build: ~1,000 tok/s continuous at batch 384)."""
    timing = timing if timing is not None else Timing()
    eos = lm.eos_ids
    src = iter(prompts)
    while True:
        rows = _take(lm, src, batch * pool, timing)
        if not rows:
            return
        rows.sort(key=lambda r: len(r.ids))
        for w in range(0, len(rows), batch):
            yield from _wave(lm, rows[w : w + batch], eos, max_answer, timing, on_step)


def left_padded(lm: LoadedModel, ids: Sequence[Sequence[int]]
                ) -> tuple[mx.array, list[int], list[BatchKVCache]]:
    """A wave's prompts as one left-padded batch [B, longest], each row's padding, and the
    empty batch caches that mask it: what a wave's prefill forward takes."""
    width = max(len(i) for i in ids)
    pad = [width - len(i) for i in ids]
    x = mx.array([[0] * p + list(i) for p, i in zip(pad, ids)], dtype=mx.uint32)
    return x, pad, [BatchKVCache(left_padding=pad) for _ in lm.model.layers]


def _wave(lm: LoadedModel, rows: list[_Row], eos: frozenset[int], max_answer: int,
          timing: Timing, on_step: Callable[[int], None] | None) -> Iterator[Sample]:
    """One wave: a padded prefill, then decode steps until every row has stopped."""
    t0 = time.perf_counter()
    x, pad, cache = left_padded(lm, [r.ids for r in rows])
    h, top = _forward(lm, x, cache)
    hn, tn = np.array(h.astype(mx.float16)), np.array(top).astype(np.int32)
    for i, r in enumerate(rows):
        r.hidden.append(hn[i, pad[i]:])
        r.top.append(tn[i, pad[i]:])
        r.answer.append(int(tn[i, -1]))
    timing.prefill += time.perf_counter() - t0

    def stopped(r: _Row) -> bool:  # a stopped row takes no more tokens: its last one says
        return r.answer[-1] in eos or len(r.answer) >= max_answer

    while not all(stopped(r) for r in rows):
        _decode_step(lm, rows, cache, timing, on_step, stopped)
    for r in rows:
        yield _finish(r, eos)
