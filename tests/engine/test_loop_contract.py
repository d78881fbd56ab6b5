"""engine/loop.py's contract beyond the committed ids (issue 36: what mutants of loop.py showed
no test pinned): the timings and statistics it reports, what the controller is told, the
default draft length, which lengths the verifier runs, when and how far a host-side drafter
drafts ahead (and with which draft probabilities), the draft sanitizer's exact rules (chains and
trees), and a grammar's blocks against max_tokens.

The committed ids themselves are pinned by test_loop_events.py, test_pipeline.py and
test_greedy_identity.py; the timings here run on a fake clock (loop.py reads only
time.perf_counter), advanced by the verifier and the proposer, so every reported figure is exact.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from engine_testkit import finished, mlx_lm_greedy

import reference_loops as loop

from macfleet.engine import pipeline
from macfleet.engine.controller import AdaptiveDraftLength, FixedDraftLength, make_controller
from macfleet.engine.events import BlockDone, Finished
from reference_loops import speculative_generate
from macfleet.engine.proposers.base import sanitize_draft
from macfleet.engine.proposers import Draft, Proposer
from macfleet.engine.proposers.base import ProposerFailed
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.verifier import SynchronousVerifier, Verifier

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
N = 40


@pytest.fixture(scope="module")
def ref(tiny) -> list[int]:
    return mlx_lm_greedy(tiny.model, PROMPT, N)


def paths(monkeypatch, ahead: bool, pad: bool) -> None:
    """Drafting ahead and padding forced on or off (their defaults depend on the device)."""
    monkeypatch.setenv(pipeline.AHEAD_ENV, "1" if ahead else "0")
    monkeypatch.setenv(pipeline.PAD_ENV, "1" if pad else "0")


def q_row(position: int, vocab: int) -> np.ndarray:
    """A draft distribution that names its output position (and gives every token mass)."""
    row = np.full(vocab, 1.0)
    row[position % vocab] += 1.0 + position
    return row / row.sum()


class Truth(Proposer):
    """Drafts the verifier's greedy continuation (`right` correct tokens, then wrong ones);
    records (context length, k) of every call. Options: host_side; `probs`: draft rows
    q_row(output position); `guess_wrong` / `empty_ahead`: a pre-draft (k = k_pre + 1) guesses
    the bonus token wrong / returns nothing; `dies_at`: ProposerFailed from that call on."""

    name = "truth"

    def __init__(self, truth, vocab, right=None, host_side=False, probs=False, k_pre=None,
                 guess_wrong=False, empty_ahead=False, dies_at=None) -> None:
        self.truth, self.vocab, self.right = list(truth), vocab, right
        self.host_side, self.probs, self.k_pre = host_side, probs, k_pre
        self.guess_wrong, self.empty_ahead, self.dies_at = guess_wrong, empty_ahead, dies_at
        self.calls: list[tuple[int, int]] = []

    def propose(self, context, k):
        self.calls.append((len(context), k))
        if self.dies_at is not None and len(self.calls) >= self.dies_at:
            raise ProposerFailed("gone")
        ahead = self.k_pre is not None and k == self.k_pre + 1
        if ahead and self.empty_ahead:
            return Draft(())
        pos = len(context) - len(PROMPT)
        toks = list(self.truth[pos : pos + k])
        if self.right is not None and len(toks) > self.right:
            toks[self.right :] = [(t + 1) % self.vocab for t in toks[self.right :]]
        if ahead and self.guess_wrong and toks:
            toks[0] = (toks[0] + 1) % self.vocab
        probs = (np.stack([q_row(pos + i, self.vocab) for i in range(len(toks))])
                 if self.probs and toks else None)
        return Draft(tuple(toks), probs)


def blocks_of(events) -> list[BlockDone]:
    return [e for e in events if isinstance(e, BlockDone)]


def committed_before(events) -> list[int]:
    """Per block, the tokens committed before it."""
    out, n = [], 0
    for e in events:
        if isinstance(e, BlockDone):
            out.append(n)
            n += e.committed
    return out


# -- timings, statistics, and what the controller is told -----------------------------------


class Clock:
    """perf_counter for loop.py; the verifier and the proposer advance it (binary fractions of
    a second, so every difference and sum is exact)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


PREFILL_S, DRAFT_S, FORWARD_S = 2**-4, 2**-7, 2**-5  # 62.5 ms, 7.8125 ms, 31.25 ms


class Recording(FixedDraftLength):
    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.seen: list[tuple] = []

    def observe(self, k, accepted, draft_ms, verify_ms):
        self.seen.append((k, accepted, draft_ms, verify_ms))


def timed_verifier(tiny, clock: Clock, counts: list[int]) -> Verifier:
    v = Verifier(tiny.model)
    prefill, forward_lazy = v.prefill, v.forward_lazy

    def timed_prefill(tokens):
        clock.now += PREFILL_S
        return prefill(tokens)

    def timed_forward_lazy(tokens):
        clock.now += FORWARD_S
        counts.append(int(tokens.shape[0]))
        return forward_lazy(tokens)

    v.prefill, v.forward_lazy = timed_prefill, timed_forward_lazy
    return v


def _timed_run(tiny, clock, forwards, proposer, ctl):
    """N tokens through the loop on the fake clock: (Finished, its BlockDone events)."""
    events = list(speculative_generate(timed_verifier(tiny, clock, forwards), proposer, PROMPT,
                                       max_tokens=N, controller=ctl))
    return finished(events), blocks_of(events)


def test_drafted_blocks_report_exact_timings_and_tell_the_controller(tiny, ref, monkeypatch):
    paths(monkeypatch, ahead=False, pad=False)
    clock = Clock()
    monkeypatch.setattr(loop, "time", clock)
    forwards: list[int] = []
    truth = Truth(ref, tiny.vocab_size)
    propose = truth.propose

    def timed_propose(context, k):
        clock.now += DRAFT_S
        return propose(context, k)

    truth.propose = timed_propose
    ctl = Recording(4)
    fin, blocks = _timed_run(tiny, clock, forwards, truth, ctl)
    assert list(fin.token_ids) == ref
    assert len(blocks) == N // 5 and forwards == [5] * (N // 5)
    for b in blocks:
        assert (b.k, b.drafted, b.accepted, b.committed) == (4, 4, 4, 5)
        assert (b.draft_ms, b.verify_ms, b.block_ms) == (7.8125, 31.25, 39.0625)
    assert ctl.seen == [(4, 4, 7.8125, 31.25)] * len(blocks)
    s = fin.stats
    assert s.prefill_ms == 62.5
    assert s.elapsed_s == PREFILL_S + len(blocks) * (DRAFT_S + FORWARD_S)
    assert (s.draft_ms, s.verify_ms) == (7.8125 * len(blocks), 31.25 * len(blocks))
    assert (s.tokens, s.blocks, s.drafted, s.accepted) == (N, 8, 32, 32)
    assert s.accepted_hist == (0, 0, 0, 0, 8) and s.proposer == "truth"


def test_pipelined_plain_steps_report_exact_timings(tiny, ref, monkeypatch):
    """A plain step started during the previous block is timed in that block's verification;
    a pipelined block waits on no drafter (draft_ms 0) and its block time is its verify time."""
    paths(monkeypatch, ahead=False, pad=False)
    clock = Clock()
    monkeypatch.setattr(loop, "time", clock)
    forwards: list[int] = []
    ctl = Recording(0)
    fin, blocks = _timed_run(tiny, clock, forwards, None, ctl)
    assert list(fin.token_ids) == ref
    assert forwards == [1] * N and len(blocks) == N
    # the first block runs its own step and starts the second; the last starts none
    assert [b.verify_ms for b in blocks] == [62.5] + [31.25] * (N - 2) + [0.0]
    assert all(b.draft_ms == 0.0 and b.block_ms == b.verify_ms for b in blocks)
    assert ctl.seen == [(0, 0, 0.0, b.verify_ms) for b in blocks]
    s = fin.stats
    assert (s.draft_ms, s.verify_ms, s.prefill_ms) == (0.0, 31.25 * N, 62.5)
    assert s.elapsed_s == PREFILL_S + N * FORWARD_S
    assert (s.drafted, s.accepted, s.accepted_hist, s.proposer) == (0, 0, (), "none")


# -- the draft length: default, 0 and 1 ----------------------------------------------------


def test_the_default_draft_length_is_4_with_a_proposer_and_0_without(tiny, ref):
    truth = Truth(ref, tiny.vocab_size)
    events = list(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N))
    assert [b.k for b in blocks_of(events)] == [4] * (N // 5)
    assert [k for _, k in truth.calls] == [4] * (N // 5)
    events = list(speculative_generate(Verifier(tiny.model), None, PROMPT, max_tokens=N))
    assert [b.k for b in blocks_of(events)] == [0] * N


def test_k0_never_asks_the_proposer_and_k1_drafts_one_token(tiny, ref):
    truth = Truth(ref, tiny.vocab_size)
    fin = finished(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                        controller=make_controller(0)))
    assert list(fin.token_ids) == ref and truth.calls == []
    assert fin.stats.proposer == "truth" and fin.stats.drafted == 0
    truth = Truth(ref, tiny.vocab_size)
    events = list(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                       controller=make_controller(1)))
    assert list(finished(events).token_ids) == ref
    assert [(b.k, b.drafted, b.accepted) for b in blocks_of(events)] == [(1, 1, 1)] * (N // 2)
    assert truth.calls == [(len(PROMPT) + n, 1) for n in range(0, N, 2)]


# -- the lengths the verifier runs ----------------------------------------------------------


def recorded(v: Verifier, lengths: list[int], lazy: list[int]) -> Verifier:
    """Record the length of every forward (`lengths`) and of those that ran lazily (`lazy`)."""
    forward, forward_lazy = v.forward, v.forward_lazy

    def eager(tokens):
        lengths.append(len(tokens))
        return forward(tokens)

    def lazily(tokens):
        lengths.append(int(tokens.shape[0]))
        lazy.append(int(tokens.shape[0]))
        return forward_lazy(tokens)

    v.forward, v.forward_lazy = eager, lazily
    return v


def test_unpadded_blocks_verify_exactly_the_block(tiny, ref, monkeypatch):
    """Off an accelerator the device's verify(L) table is never probed and a block of a root
    and k drafts is one forward of k + 1 tokens; a plain step is one token."""
    paths(monkeypatch, ahead=False, pad=False)

    def no_probe(model):
        raise AssertionError("verify(L) probed on the unpadded path")

    monkeypatch.setattr(loop, "verify_costs", no_probe)
    for make in (Verifier, SynchronousVerifier):
        lengths: list[int] = []
        lazy: list[int] = []
        events = list(speculative_generate(recorded(make(tiny.model), lengths, lazy),
                                           Truth(ref, tiny.vocab_size, right=2), PROMPT,
                                           max_tokens=N, controller=make_controller(4)))
        assert list(finished(events).token_ids) == ref
        # blocks of 3 committed: 4 drafts while 5 tokens fit, then 3, then a plain step
        assert lengths == [b.drafted + 1 for b in blocks_of(events)]
        assert lengths == [5] * 12 + [4, 1]
        # only the plain verifier runs lazily (a verifier that overrides forward, a sharded
        # one, must get every block through its forward)
        assert lazy == (lengths if make is Verifier else [])
        lengths, lazy = [], []
        finished(speculative_generate(recorded(make(tiny.model), lengths, lazy), None, PROMPT,
                                      max_tokens=N))
        assert lengths == [1] * N and lazy == (lengths if make is Verifier else [])


def test_padded_blocks_run_at_the_tables_length_on_the_pipelined_verifier_only(
        tiny, ref, monkeypatch):
    paths(monkeypatch, ahead=False, pad=True)

    def costs(model):
        assert model is tiny.model
        return {1: 1.0, 2: 3.0, 8: 2.0, 16: 9.0}

    monkeypatch.setattr(loop, "verify_costs", costs)
    for make, want in ((Verifier, [8] * 13 + [1]), (SynchronousVerifier, [5] * 12 + [4, 1])):
        lengths: list[int] = []
        v = recorded(make(tiny.model), lengths, [])
        fin = finished(speculative_generate(v, Truth(ref, tiny.vocab_size, right=2), PROMPT,
                                            max_tokens=N, controller=make_controller(4)))
        assert list(fin.token_ids) == ref
        assert lengths == want, make
        assert v.offset == len(PROMPT) + N - 1


# -- drafting ahead -------------------------------------------------------------------------


def test_a_fixed_length_drafter_drafts_ahead_exactly_k_past_the_guess(tiny, ref, monkeypatch):
    paths(monkeypatch, ahead=True, pad=False)
    truth = Truth(ref, tiny.vocab_size, host_side=True, k_pre=4)
    events = list(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                       controller=make_controller(4)))
    assert list(finished(events).token_ids) == ref
    blocks = blocks_of(events)
    assert [(b.k, b.drafted, b.accepted) for b in blocks] == [(4, 4, 4)] * (N // 5)
    # one fresh draft, then one pre-draft per block (k + 1: the guess and k drafts), each from
    # the context the block ends with, less the bonus token it guesses
    before = committed_before(events)
    assert truth.calls == [(len(PROMPT), 4)] + [(len(PROMPT) + n - 1, 5) for n in before[1:]]


def test_an_adaptive_controller_drafts_ahead_at_its_largest_length(tiny, ref, monkeypatch):
    paths(monkeypatch, ahead=True, pad=False)
    ctl = AdaptiveDraftLength(k_max=6)
    truth = Truth(ref, tiny.vocab_size, host_side=True, k_pre=6)
    events = list(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                       controller=ctl))
    assert list(finished(events).token_ids) == ref
    assert sum(k == 7 for _, k in truth.calls) >= 2
    assert all(b.drafted == b.accepted == b.k for b in blocks_of(events))


def test_no_drafting_ahead_off_its_path_or_for_a_device_drafter(tiny, ref, monkeypatch):
    """Every call then starts from the committed context (one per block)."""
    for ahead, host in ((False, True), (True, False)):
        paths(monkeypatch, ahead=ahead, pad=False)
        truth = Truth(ref, tiny.vocab_size, host_side=host)
        events = list(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                           controller=make_controller(4)))
        assert list(finished(events).token_ids) == ref
        assert truth.calls == [(len(PROMPT) + n, 4) for n in committed_before(events)]


def test_a_wrong_guess_or_an_empty_pre_draft_costs_a_fresh_draft(tiny, ref, monkeypatch):
    paths(monkeypatch, ahead=True, pad=False)
    for opt in ("guess_wrong", "empty_ahead"):
        truth = Truth(ref, tiny.vocab_size, host_side=True, k_pre=4, **{opt: True})
        events = list(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                           controller=make_controller(4)))
        assert list(finished(events).token_ids) == ref
        assert all(b.drafted == b.accepted == 4 for b in blocks_of(events))
        before = committed_before(events)
        want = [(len(PROMPT), 4)]
        for n in before[1:]:
            want += [(len(PROMPT) + n - 1, 5), (len(PROMPT) + n, 4)]
        assert truth.calls == want, opt


def test_a_host_drafter_that_fails_while_drafting_ahead_is_dropped_at_its_next_draft(
        tiny, ref, monkeypatch):
    paths(monkeypatch, ahead=True, pad=False)
    truth = Truth(ref, tiny.vocab_size, host_side=True, k_pre=4, dies_at=3)
    events = list(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                       controller=make_controller(4)))
    assert list(finished(events).token_ids) == ref
    # call 1 fresh, 2 ahead (used by block 2), 3 ahead (fails), 4 fresh (fails: dropped)
    assert len(truth.calls) == 4
    assert [b.drafted for b in blocks_of(events)][:3] == [4, 4, 0]
    assert all(b.drafted == 0 for b in blocks_of(events)[2:])


def test_drafts_made_ahead_carry_their_own_tokens_probabilities(tiny, ref, monkeypatch):
    """A sampled block drafted ahead verifies each draft token against its own draft row q:
    the pre-draft's rows shifted past its guess, never the guess's row."""
    paths(monkeypatch, ahead=True, pad=False)
    seen = []
    outcome = loop.chain_outcome

    def spy(draft, logits, params, seed, start):
        seen.append((draft, start))
        return outcome(draft, logits, params, seed, start)

    monkeypatch.setattr(loop, "chain_outcome", spy)
    truth = Truth(ref, tiny.vocab_size, host_side=True, probs=True, k_pre=4)
    # the smallest nucleus: the verifier samples its argmax, so the greedy truth is accepted
    params = SamplingParams(1.0, top_p=1e-9, seed=3)
    fin = finished(speculative_generate(Verifier(tiny.model), truth, PROMPT, params=params,
                                        max_tokens=N, controller=make_controller(4)))
    assert list(fin.token_ids) == ref
    assert sum(k == 5 for _, k in truth.calls) >= 5  # the blocks were drafted ahead
    drafted = [(d, s) for d, s in seen if d.tokens]
    assert len(drafted) == N // 5
    for d, start in drafted:
        assert d.probs is not None and d.probs.shape == (len(d.tokens), tiny.vocab_size)
        for i in range(len(d.tokens)):
            np.testing.assert_array_equal(d.probs[i], q_row(start + i, tiny.vocab_size))


# -- a grammar's blocks ---------------------------------------------------------------------


def test_a_grammar_answer_stops_at_max_tokens_even_inside_forced_tokens(tiny, monkeypatch):
    """The forced literal "id: " is drafted for free, but never past max_tokens; the answer
    matches the grammar, ends where it completes, and drafts (padded ones too: a grammar's
    blocks are read on the host, from their own rows only) do not change it."""
    from macfleet.engine.constraint import REGEX, Grammar
    from reference_loops import generate_local

    pattern = r"id: [a-z]{2,6}; n [0-9]{1,3}\."
    g = Grammar(REGEX, pattern)

    def answer(m, proposer="none"):
        fin = list(generate_local(tiny, "some prompt here", chat=False, proposer=proposer,
                                  draft_tokens=4, max_tokens=m, grammar=g))[-1]
        assert isinstance(fin, Finished)
        return list(fin.token_ids), fin.stats.finish_reason

    full, reason = answer(40)
    assert reason == "stop" and re.fullmatch(pattern, tiny.tokenizer.decode(full))
    assert answer(40, "ngram") == (full, "stop")
    paths(monkeypatch, ahead=False, pad=True)
    monkeypatch.setattr(loop, "verify_costs", lambda model: {1: 1.0, 2: 3.0, 8: 2.0, 16: 9.0})
    assert answer(40, "ngram") == (full, "stop")
    paths(monkeypatch, ahead=False, pad=False)
    for m in (1, 2, 3, 4, 6):
        assert answer(m) == (full[:m], "length"), m
    # max_tokens 5: the whole literal and the verifier's token, in one block
    fin = list(generate_local(tiny, "some prompt here", chat=False, proposer="none",
                              max_tokens=5, grammar=g))[-1]
    assert (fin.stats.blocks, fin.stats.drafted, fin.stats.accepted) == (1, 4, 4)


# -- arguments and a proposer that fails -------------------------------------------------


def test_a_prompt_may_hold_any_id_of_the_vocabulary_and_an_empty_one_is_refused(tiny):
    last = tiny.vocab_size - 1
    fin = finished(speculative_generate(Verifier(tiny.model), None, [0, last, 0], max_tokens=3))
    assert list(fin.token_ids) == mlx_lm_greedy(tiny.model, [0, last, 0], 3)
    with pytest.raises(ValueError, match="^empty prompt$"):
        next(speculative_generate(Verifier(tiny.model), None, []))


def test_a_failing_proposer_is_named_in_the_log(tiny, ref, caplog):
    truth = Truth(ref, tiny.vocab_size, dies_at=1)
    with caplog.at_level(logging.WARNING, logger=loop.__name__):
        fin = finished(speculative_generate(Verifier(tiny.model), truth, PROMPT, max_tokens=N,
                                            controller=make_controller(4)))
    assert list(fin.token_ids) == ref and len(truth.calls) == 1
    assert [r.getMessage() for r in caplog.records if r.name == loop.__name__] == [
        "proposer truth failed (gone): continuing without it"]


# -- the draft sanitizer --------------------------------------------------------------------


def test_sanitize_keeps_valid_token_ids_and_the_drafts_timing():
    assert sanitize_draft(Draft((0, 63, 5)), 8, 64).tokens == (0, 63, 5)
    assert sanitize_draft(Draft((np.int64(2), np.int32(7))), 8, 64).tokens == (2, 7)
    d = sanitize_draft(Draft((np.int64(2), np.int64(70))), 8, 64)
    assert d.tokens == (2,) and type(d.tokens[0]) is int
    cut = sanitize_draft(Draft((1, 64, 2), draft_ms=2.5), 8, 64)
    assert (cut.tokens, cut.draft_ms) == ((1,), 2.5)
    assert sanitize_draft(Draft((1, -1, 2)), 8, 64).tokens == (1,)
    assert sanitize_draft(Draft((1, 2.0, 2)), 8, 64).tokens == (1,)
    same = Draft((1, 2), draft_ms=1.5)
    assert sanitize_draft(same, 8, 64) is same


def test_sanitize_keeps_a_pmf_and_drops_each_kind_of_bad_probabilities():
    good = np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    kept = sanitize_draft(Draft((1, 2), good), 8, 4)
    assert kept.probs.dtype == np.float64
    np.testing.assert_array_equal(kept.probs, good)  # zeros are a pmf (a top-p draft)
    extra = np.vstack([good, [np.nan, 0, 0, 0]])  # rows past the drafts are not read
    np.testing.assert_array_equal(sanitize_draft(Draft((1, 2), extra), 8, 4).probs, good)
    np.testing.assert_array_equal(sanitize_draft(Draft((1, 2), good), 1, 4).probs, good[:1])
    near = good.astype(np.float64) * (1 + 5e-4)  # within the tolerance
    np.testing.assert_array_equal(sanitize_draft(Draft((1, 2), near), 8, 4).probs, near)
    bad = {
        "a list": good.tolist(),
        "3-d": good[:, None, :],
        "another vocabulary": np.hstack([good, np.zeros((2, 1))]),
        "too few rows": good[:1],
        "negative": np.array([[1.5, -0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]),
        "infinite": np.array([[np.inf, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]),
        "nan": np.array([[np.nan, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]]),
        "not normalised": good * 1.002,
    }
    for why, probs in bad.items():
        d = sanitize_draft(Draft((1, 2), probs), 8, 4)
        assert d.tokens == (1, 2) and d.probs is None, why


def test_sanitize_keeps_the_valid_prefix_of_a_tree():
    """Tree drafts (parents): a node is kept while its parent is -1 (the root) or an earlier
    node, and its token is valid; the first bad node ends the draft."""
    t = Draft((1, 2, 3, 4), parents=(-1, 0, 0, 1))
    assert sanitize_draft(t, 8, 64) is t

    def kept(tokens, parents, k=8):
        d = sanitize_draft(Draft(tuple(tokens), parents=tuple(parents)), k, 64)
        return d.tokens, d.parents

    assert kept((1, 2, 3, 4), (-1, 0, 2, 1)) == ((1, 2), (-1, 0))  # a parent not before it
    assert kept((1, 2, 3), (-1, -2, 0)) == ((1,), (-1,))
    assert kept((1, 2, 3), (-1, 0, 1.0)) == ((1, 2), (-1, 0))
    assert kept((1, 2, 3), (-1, -1, 1)) == ((1, 2, 3), (-1, -1, 1))  # two children of the root
    assert kept((1, 2, 3), (0, 0, 1)) == ((), ())  # the first node's parent must be the root
    assert kept((1, 2), (-1, 0, 1)) == ((1, 2), (-1, 0))  # parents past the tokens
    assert kept((1, 99, 3), (-1, 0, 1)) == ((1,), (-1,))  # a bad token ends the tree too
    assert kept((1, 2, 3), (-1, 0, 1), k=2) == ((1, 2), (-1, 0))
    d = sanitize_draft(Draft((1, 2, 3), parents=(np.int64(-1), np.int64(0), np.int64(0))), 8,
                       64)
    assert d.tokens == (1, 2, 3) and d.parents == (-1, 0, 0)
    probs = np.full((3, 4), 0.25)
    d = sanitize_draft(Draft((1, 2, 3), probs, parents=(-1, 0, 5)), 8, 4)
    assert d.parents == (-1, 0) and d.probs.shape == (2, 4)
    assert sanitize_draft(Draft((1, 2)), 8, 64).parents is None
