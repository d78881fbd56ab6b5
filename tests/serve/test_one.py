"""`generate --local` through the serving engine (serve/one.py): one request, a batch of one,
stepped on the caller's thread. Its greedy ids are the single-session loops' (greedy margin
rule, tests/tolerance.py: a flat batch against a verify block), its events the same kinds in
the same order; a model the flat batch cannot run decodes on its own forward; a caller that
stops reading frees the session."""

from __future__ import annotations

import mlx.core as mx
import pytest

from macfleet.engine.events import BlockDone, Finished
from macfleet.engine.models import load_model
from macfleet.engine.proposers import Draft, Proposer
from macfleet.engine.proposers.group import ProposerGroup
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.text import TextDelta
from reference_loops import generate_local
from macfleet.serve import engine as serve_engine
from macfleet.serve import one
from macfleet.serve.one import decode_ids, generate_one

MODEL = "tiny:3"
PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


def ids(events) -> list[int]:
    return list(next(e for e in events if isinstance(e, Finished)).token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["none", "ngram", "ngram+ngram:2"])
def test_greedy_ids_and_events_are_the_loops(lm, spec):
    loop = list(generate_local(lm, PROMPT, chat=False, proposer=spec, max_tokens=24))
    eng = list(generate_one(lm, PROMPT, chat=False, proposer=spec, max_tokens=24))
    assert ids(eng) == ids(loop)
    text = "".join(e.text for e in eng if isinstance(e, TextDelta))
    assert text == "".join(e.text for e in loop if isinstance(e, TextDelta))
    assert isinstance(eng[-1], Finished) and any(isinstance(e, BlockDone) for e in eng)
    committed = [t for e in eng if isinstance(e, TextDelta) for t in e.tokens]
    assert committed == ids(eng)
    assert eng[-1].stats.tokens == len(ids(eng)) and eng[-1].stats.proposer != ""


def test_a_model_the_flat_batch_cannot_run_decodes_on_its_own_forward(lm, monkeypatch):
    """Such a model (not llama's attention: serve/engine.py) runs the engine's batch-invariant
    mode: each block, a tree's too, the model's own forward, so its greedy ids are plain
    decoding's exactly."""
    from mlx_lm.generate import generate_step

    monkeypatch.setattr(serve_engine, "supports_tree_attention", lambda model: False)
    out = list(generate_one(lm, PROMPT, chat=False, proposer="ngram", max_tokens=24))
    prompt = lm.tokenizer.encode(PROMPT)
    want = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(prompt), lm.model)),
                                   range(24))]
    assert ids(out) == want and out[-1].stats.drafted > 0
    tree = list(generate_one(lm, PROMPT, chat=False, proposer="ngram+ngram:2", max_tokens=24))
    assert ids(tree) == want and tree[-1].stats.drafted > 0


def test_a_caller_that_stops_reading_frees_the_session(lm, monkeypatch):
    engines = []
    real = one.BatchEngine
    monkeypatch.setattr(one, "BatchEngine", lambda *a, **kw: engines.append(real(*a, **kw))
                        or engines[-1])
    gen = generate_one(lm, PROMPT, chat=False, proposer="none", max_tokens=200)
    next(e for e in gen if isinstance(e, TextDelta))
    gen.close()
    (engine,) = engines
    assert engine.table.active == [] and not engine.step()
    assert engine.iterations < 20  # not decoded on to its 200 tokens (one block an iteration)


def test_bad_input_is_a_value_error_before_anything_runs(lm):
    with pytest.raises(ValueError):
        list(generate_one(lm, "", chat=False))
    with pytest.raises(ValueError):
        list(generate_one(lm, PROMPT, chat=False, max_tokens=-1))


@pytest.mark.parametrize("fails_in", ["reset", "forward"])
def test_a_given_verifiers_failure_is_raised_to_its_owner(lm, fails_in):
    """A sharded verifier that loses a rank fails its agent, not one request: its error comes
    out of the engine as it is (agents/verifier_service.py ends the service on it)."""
    from macfleet.engine.verifier import Verifier

    class Lost(RuntimeError):
        pass

    class Breaks(Verifier):
        def forward(self, tokens):
            if fails_in == "forward":
                raise Lost("rank 1 vanished")
            return super().forward(tokens)

        def reset(self):
            if fails_in == "reset":
                raise Lost("rank 1 vanished")
            super().reset()

    with pytest.raises(Lost):
        list(one.decode_ids(lm, [1, 2, 3, 4], max_tokens=4, verifier=Breaks(lm.model)))


def test_a_grammar_answer_stops_at_max_tokens_even_inside_forced_tokens(lm):
    """The forced literal "id: " is drafted for free, but never past max_tokens; the answer
    matches the grammar, ends where it completes, and drafts do not change it."""
    import re

    from macfleet.engine.constraint import REGEX, Grammar

    pattern = r"id: [a-z]{2,6}; n [0-9]{1,3}\."
    g = Grammar(REGEX, pattern)

    def answer(m, proposer="none"):
        fin = list(generate_one(lm, "some prompt here", chat=False, proposer=proposer,
                                draft_tokens=4, max_tokens=m, grammar=g))[-1]
        assert isinstance(fin, Finished)
        return list(fin.token_ids), fin.stats.finish_reason

    full, reason = answer(40)
    assert reason == "stop" and re.fullmatch(pattern, lm.tokenizer.decode(full))
    assert answer(40, "ngram") == (full, "stop")
    for m in (1, 2, 3, 4, 6):
        assert answer(m) == (full[:m], "length"), m
    # max_tokens 5: the whole literal and the verifier's token, in one block
    fin = list(generate_one(lm, "some prompt here", chat=False, proposer="none",
                            max_tokens=5, grammar=g))[-1]
    assert (fin.stats.blocks, fin.stats.drafted, fin.stats.accepted) == (1, 4, 4)



class TreeOracle(Proposer):
    """Drafts `truth` (`right` tokens of it, then wrong ones) and a wrong sibling branch, with
    no probabilities (exact-match acceptance)."""

    drafts_trees = True

    def __init__(self, name, truth, at, vocab, right=None) -> None:
        self.name, self.truth, self.at = name, list(truth), at
        self.vocab, self.right = vocab, right

    def propose(self, context, k):
        pos = len(context) - self.at
        good = self.truth[pos:pos + max(1, min(4, k // 2))]
        if self.right is not None:
            good = good[:self.right] + [(t + 1) % self.vocab for t in good[self.right:]]
        bad = [(t + 2) % self.vocab for t in good]
        par = [*range(-1, len(good) - 1), -1, *range(len(good), len(good) + len(bad) - 1)]
        return Draft((*good, *bad), parents=tuple(par))


@pytest.mark.slow
def test_sampled_trees_of_exact_match_drafts_commit_what_plain_sampling_draws(lm):
    """Drafts without probabilities are accepted on the device with draws keyed by the seed
    and each token's output position: the same ids as the verifier sampling alone; the drafts
    were really walked; another seed draws otherwise."""
    prompt = lm.tokenizer.encode(PROMPT)
    hot = SamplingParams(1.3, top_p=0.9, seed=21)
    plain = ids(decode_ids(lm, prompt, None, params=hot, max_tokens=40))
    group = ProposerGroup([TreeOracle("a", plain, len(prompt), lm.vocab_size),
                           TreeOracle("b", plain, len(prompt), lm.vocab_size, 1)],
                          draft_tokens=6)
    out = list(decode_ids(lm, prompt, group, params=hot, max_tokens=40))
    assert ids(out) == plain and out[-1].stats.accepted >= 20
    other = ids(decode_ids(lm, prompt, None, params=SamplingParams(1.3, top_p=0.9, seed=22),
                           max_tokens=40))
    assert other != plain


@pytest.mark.slow
def test_tree_drafts_with_probabilities_take_the_ratio_rule_seeded(lm, monkeypatch):
    """A draft model's drafts carry probabilities: SpecInfer's rule decides on the host with
    the request's generator, so a seed fixes the output and another seed changes it."""
    from macfleet.engine.proposers import make_proposer
    from macfleet.serve import decode

    rules = []
    real = decode.accept_tree_sample
    monkeypatch.setattr(decode, "accept_tree_sample",
                        lambda tree, *a: rules.append(tree) or real(tree, *a))
    prompt = lm.tokenizer.encode(PROMPT)

    def sample(seed):
        group = ProposerGroup([make_proposer("draft:tiny:2:64", lm)], draft_tokens=3)
        return list(decode_ids(lm, prompt, group, params=SamplingParams(1.0, seed=seed),
                               max_tokens=20))[-1]

    a = sample(5)
    assert rules and a.stats.accepted > 0 and len(a.token_ids) == 20
    assert sample(5).token_ids == a.token_ids and sample(6).token_ids != a.token_ids
