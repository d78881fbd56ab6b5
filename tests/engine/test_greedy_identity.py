"""Greedy decoding is bit-identical to the verifier alone, whatever the proposer does.

Reference: mlx-lm's own `generate_step` (greedy) on the same model, cut at EOS, same max tokens.
Real-model generations are kept short (10 tokens) and few: every proposer x 2 of the 3 prompts
at k=4 (layerskip on one), plus two adaptive (`auto`) cases. Malicious proposers run on a tiny
model.

Token ids: the "greedy margin" rule of tests/tolerance.py (verify blocks of L tokens vs
mlx-lm's one token per forward).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import pytest
from engine_testkit import finished, mlx_lm_greedy

from macfleet.engine.controller import make_controller
from reference_loops import speculative_generate
from macfleet.engine.proposers import Draft, Proposer, make_proposer
from macfleet.engine.text import encode_prompt
from macfleet.engine.verifier import Verifier

MAX_TOKENS = 10
PROMPTS = {
    "chat": "What is the capital of France?",
    "code": "Write a Python function that returns the factorial of n.",
    "summary": (
        "Summarize this text: The quick brown fox jumps over the lazy dog. The dog was not "
        "amused, and the fox ran away into the forest."
    ),
}


@pytest.fixture(scope="module")
def references(smollm2) -> dict[str, tuple[list[int], list[int]]]:
    """prompt name -> (prompt ids, mlx-lm greedy output ids), computed once per module."""
    refs = {}
    for name, text in PROMPTS.items():
        ids = encode_prompt(smollm2.tokenizer, text, chat=True)
        refs[name] = (ids, mlx_lm_greedy(smollm2.model, ids, MAX_TOKENS, smollm2.eos_ids))
    return refs


@pytest.fixture(scope="module")
def verifier(smollm2) -> Verifier:
    return Verifier(smollm2.model)


def run(lm, verifier, proposer_spec: str, draft_tokens, ids, max_tokens=MAX_TOKENS):
    prop = make_proposer(proposer_spec, lm)
    ctl = make_controller(draft_tokens if prop is not None else 0)
    return finished(speculative_generate(verifier, prop, ids, max_tokens=max_tokens,
                                         controller=ctl, eos_ids=lm.eos_ids))


@pytest.mark.slow
def test_references_cover_eos_and_length(references):
    """The prompts exercise both ends: an answer that stops at EOS, one cut at max tokens."""
    lens = {name: len(out) for name, (_, out) in references.items()}
    assert lens["chat"] < MAX_TOKENS, lens
    assert lens["code"] == lens["summary"] == MAX_TOKENS, lens


# Each proposer on the answer that stops at EOS (chat) and on one cut at max tokens where its
# drafts are accepted (measured: n-gram 6 of 10 drafted on summary, 1 of 11 on code;
# layerskip:12 2 of 27 on summary, none of 30 on code), not on every prompt: a third prompt
# gave another text, not another path through the loop (~9 s of smollm2 per sweep).
# layerskip:12 on chat only: it is a ModelProposer as draft:smollm2 is (a model cut to its
# first layers), and the verifier's rollback after a partly accepted block is n-gram's on
# summary (layerskip's summary and its k=1 case went: docs/testing.md, ninth round)
@pytest.mark.slow
@pytest.mark.parametrize("proposer,prompt", [
    ("none", "chat"), ("none", "code"),
    ("ngram", "chat"), ("ngram", "summary"),
    ("layerskip:12", "chat"),
    ("draft:smollm2", "chat"), ("draft:smollm2", "code"),
])
def test_greedy_identical_k4(smollm2, verifier, references, proposer, prompt):
    ids, ref = references[prompt]
    fin = run(smollm2, verifier, proposer, 4, ids)
    assert list(fin.token_ids) == ref, smollm2.tokenizer.decode(list(fin.token_ids))
    assert fin.stats.finish_reason == ("stop" if len(ref) < MAX_TOKENS else "length")
    if proposer == "draft:smollm2":
        # the verifier as its own draft: everything is accepted, 5 tokens per block
        assert fin.stats.acceptance == 1.0
        assert fin.stats.blocks <= -(-len(ref) // 5) + 1


@pytest.mark.slow
@pytest.mark.parametrize("proposer,draft_tokens,prompt", [
    ("ngram", "auto", "summary"),
    ("draft:smollm2", "auto", "code"),
])
def test_greedy_identical_other_k(smollm2, verifier, references, proposer, draft_tokens, prompt):
    ids, ref = references[prompt]
    fin = run(smollm2, verifier, proposer, draft_tokens, ids)
    assert list(fin.token_ids) == ref


class MaliciousProposer(Proposer):
    """Returns garbage of one kind (or a random mix): wrong tokens, bad ids, bad probabilities."""

    def __init__(self, mode: str, vocab: int, prompt_len: int, truth: Sequence[int] = (),
                 seed: int = 0) -> None:
        self.mode, self.vocab, self.truth = mode, vocab, list(truth)
        self.prompt_len = prompt_len
        self.name = f"malicious:{mode}"
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def _correct(self, context: Sequence[int], n: int) -> list[int]:
        """The verifier's true continuation (when known), so the garbage lands mid-block."""
        start = len(context) - self.prompt_len
        return list(self.truth[start : start + n])

    def propose(self, context, k):
        self.calls += 1
        r = self.rng
        mode = self.mode
        if mode == "mix":
            mode = str(r.choice(["random", "out_of_range", "too_many", "nan_probs",
                                 "bad_probs", "half_right", "wrong_types"]))
        v = self.vocab
        rand = [int(t) for t in r.integers(0, v, size=k)]
        if mode == "random":
            return Draft(tuple(rand))
        if mode == "out_of_range":
            return Draft(tuple(self._correct(context, 1) + [v, -1, 10**9, v + 5][: k]))
        if mode == "too_many":
            return Draft(tuple(self._correct(context, 3 * k + 7) + rand * 4))
        if mode == "nan_probs":
            probs = np.full((k, v), np.nan)
            return Draft(tuple(rand), probs)
        if mode == "bad_probs":  # wrong shape, negative, not normalised: all must be ignored
            shape = [(k, v + 1), (k,), (k, v)][int(r.integers(0, 3))]
            return Draft(tuple(rand), -np.ones(shape))
        if mode == "half_right":
            good = self._correct(context, k // 2 + 1)
            return Draft(tuple(good + rand)[:k])
        if mode == "wrong_types":
            return Draft(tuple(self._correct(context, 1)) + (1.5, "7", None, 3)[:k])
        raise AssertionError(mode)


MALICE_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def malice_ref(tiny) -> list[int]:
    """The tiny model's 30 greedy tokens after MALICE_PROMPT (mlx-lm), once for the 24 cases."""
    return mlx_lm_greedy(tiny.model, MALICE_PROMPT, 30)


# the fast lane: every mode at k=4, and k=1 and the chosen lengths with the mixed one
@pytest.mark.parametrize("k, mode", [
    (k, m) if k == 4 or m == "mix" else pytest.param(k, m, marks=pytest.mark.slow)
    for k in (1, 4, "auto") for m in ("random", "out_of_range", "too_many", "nan_probs",
                                      "bad_probs", "half_right", "wrong_types", "mix")])
def test_malicious_proposer_cannot_change_greedy_output(tiny, malice_ref, mode, k):
    prompt, ref = MALICE_PROMPT, malice_ref
    bad = MaliciousProposer(mode, tiny.vocab_size, len(prompt), truth=ref,
                            seed=zlib.crc32(f"{mode}{k}".encode()))
    fin = finished(speculative_generate(Verifier(tiny.model), bad, prompt, max_tokens=30,
                                        controller=make_controller(k)))
    assert list(fin.token_ids) == ref
    assert bad.calls > 0
    assert fin.stats.tokens == 30 and fin.stats.finish_reason == "length"
    if mode in ("too_many", "half_right"):
        assert fin.stats.accepted > 0  # the right part of the draft was used
    if mode == "out_of_range":
        assert fin.stats.drafted == fin.stats.accepted  # only the valid first token survives


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["random", "out_of_range", "nan_probs", "bad_probs", "mix"])
def test_malicious_proposer_when_sampling(tiny, mode):
    """Sampling: garbage drafts and probabilities are dropped, never crash the loop or leak
    an invalid id; bad probabilities fall back to exact-match acceptance."""
    from macfleet.engine.sampling import SamplingParams

    prompt = MALICE_PROMPT
    bad = MaliciousProposer(mode, tiny.vocab_size, len(prompt), seed=7)
    fin = finished(speculative_generate(Verifier(tiny.model), bad, prompt, max_tokens=30,
                                        params=SamplingParams(1.0, seed=1),
                                        controller=make_controller(4)))
    assert len(fin.token_ids) == 30
    assert all(0 <= t < tiny.vocab_size for t in fin.token_ids)
