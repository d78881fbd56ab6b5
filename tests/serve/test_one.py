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
from macfleet.engine.text import TextDelta
from reference_loops import generate_local
from macfleet.serve import engine as serve_engine
from macfleet.serve import one
from macfleet.serve.one import generate_one

MODEL = "tiny:3"
PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


def ids(events) -> list[int]:
    return list(next(e for e in events if isinstance(e, Finished)).token_ids)


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
