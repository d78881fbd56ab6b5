"""The speculative decoding loop: a generator of typed events.

    prompt ids -> prefill -> [ propose k -> verify k+1 in one forward -> accept -> roll back ]*

Invariants (checked by tests on real models):
* greedy: the committed ids equal the verifier decoding alone, whatever the proposer returns;
* sampling: each committed token is distributed as the verifier's own (ratio test with draft
  probabilities, exact-match sampling without);
* the verifier's cache holds exactly the committed tokens minus the last one at every yield.
A proposer that raises or returns garbage costs speed, never correctness: its draft is
truncated to what is valid, or dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np

from macfleet.engine.acceptance import accept_exact_sample, accept_greedy, accept_ratio
from macfleet.engine.controller import FixedDraftLength
from macfleet.engine.events import BlockDone, Event, Finished, GenerationStats, TokensCommitted
from macfleet.engine.proposers.base import EMPTY_DRAFT, Draft, Proposer, ProposerFailed
from macfleet.engine.sampling import GREEDY, SamplingParams, make_rng, probs_from_logits
from macfleet.engine.verifier import Verifier

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


def _tree_prefix(parents: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
    """The longest prefix of `parents` (at most n) in which every parent precedes its child."""
    if parents is None:
        return None
    out: list[int] = []
    for i, p in enumerate(list(parents)[:n]):
        if not isinstance(p, (int, np.integer)) or not -1 <= int(p) < i:
            break
        out.append(int(p))
    return tuple(out)


def sanitize_draft(draft: Draft, k: int, vocab: int) -> Draft:
    """Keep the longest valid prefix of a draft; drop probabilities that are not a [n, V] pmf.

    A tree draft (parents) keeps the prefix of nodes whose tokens and parents are valid."""
    toks: list[int] = []
    for t in draft.tokens[:k]:
        if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab:
            break
        toks.append(int(t))
    parents = _tree_prefix(draft.parents, len(toks))
    if parents is not None:
        toks = toks[: len(parents)]
    probs = draft.probs
    if probs is not None:
        ok = (
            isinstance(probs, np.ndarray) and probs.ndim == 2 and probs.shape[1] == vocab
            and probs.shape[0] >= len(toks) and np.all(np.isfinite(probs[: len(toks)]))
            and np.all(probs[: len(toks)] >= 0)
            and np.allclose(probs[: len(toks)].sum(axis=1), 1.0, atol=1e-3)
        )
        probs = probs[: len(toks)].astype(np.float64) if ok else None
    if len(toks) == len(draft.tokens) and probs is draft.probs and parents == draft.parents:
        return draft
    return Draft(tuple(toks), probs, draft.draft_ms, None, parents)


def speculative_generate(
    verifier: Verifier,
    proposer: Proposer | None,
    prompt: Sequence[int],
    *,
    params: SamplingParams = GREEDY,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    controller=None,
    eos_ids: frozenset[int] = frozenset(),
) -> Iterator[Event]:
    """Yield TokensCommitted and BlockDone events, then one Finished."""
    if not prompt:
        raise ValueError("empty prompt")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    vocab = int(verifier.model.args.vocab_size)
    if any(not 0 <= int(t) < vocab for t in prompt):
        raise ValueError(f"prompt has token ids outside the vocabulary (0..{vocab - 1})")
    controller = controller or FixedDraftLength(4 if proposer else 0)
    rng = make_rng(params, stream=0)
    t_start = time.perf_counter()
    verifier.reset()
    proposer_name = proposer.name if proposer is not None else "none"
    if proposer is not None:
        proposer.start(params)
    context = [int(t) for t in prompt]
    verifier.prefill(context[:-1])
    prefill_ms = (time.perf_counter() - t_start) * 1e3
    generated: list[int] = []
    hist = [0] * 65
    blocks = drafted_total = accepted_total = 0
    draft_total = verify_total = 0.0
    finish = "length"
    try:
        while len(generated) < max_tokens:
            t0 = time.perf_counter()
            k = min(controller.next_k(), max_tokens - len(generated) - 1)
            draft = EMPTY_DRAFT
            if proposer is not None and k > 0:
                try:
                    draft = sanitize_draft(proposer.propose(context, k), k, vocab)
                except ProposerFailed as e:
                    log.warning("proposer %s failed (%s): continuing without it",
                                proposer.name, e)
                    proposer = None
            t1 = time.perf_counter()
            block_in = [context[-1], *draft.tokens]
            logits = verifier.forward(block_in)  # [k + 1, V]
            if params.greedy:
                target = np.array(mx.argmax(logits, axis=-1)).tolist()
                n, nxt = accept_greedy(draft.tokens, target)
            else:
                p = probs_from_logits(logits, params)
                if draft.probs is not None:
                    n, nxt = accept_ratio(draft.tokens, draft.probs, p, rng)
                else:
                    n, nxt = accept_exact_sample(draft.tokens, p, rng)
            verifier.rollback(len(draft) - n)
            t2 = time.perf_counter()
            new = [*draft.tokens[:n], nxt]
            stop_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
            if stop_at is not None:
                new = new[:stop_at]
                finish = "stop"
            context.extend(new)
            generated.extend(new)
            blocks += 1
            if len(draft):
                hist[n] += 1
                drafted_total += len(draft)
                accepted_total += n
            dms, vms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            draft_total += dms
            verify_total += vms
            controller.observe(len(draft), n, dms, vms)
            if new:
                yield TokensCommitted(blocks, tuple(new))
            yield BlockDone(block=blocks, k=k, drafted=len(draft), accepted=n,
                            committed=len(new), draft_ms=dms, verify_ms=vms,
                            block_ms=(time.perf_counter() - t0) * 1e3)
            if finish == "stop":
                break
    finally:
        if proposer is not None:
            proposer.close()
    while hist and hist[-1] == 0 and len(hist) > 1:
        hist.pop()
    stats = GenerationStats(
        tokens=len(generated), elapsed_s=time.perf_counter() - t_start, prefill_ms=prefill_ms,
        blocks=blocks, drafted=drafted_total, accepted=accepted_total, draft_ms=draft_total,
        verify_ms=verify_total, proposer=proposer_name,
        finish_reason=finish, accepted_hist=tuple(hist) if drafted_total else (),
    )
    yield Finished(stats, tuple(generated))
