"""Predicted Outputs in the serving engine (tiny random model): a request's prediction drafts
beside the session's other drafters in one token tree; greedy answers stay exactly plain
decoding's, and the prediction's own counts are what the API reports."""

from __future__ import annotations

import numpy as np
import pytest
from engine_parts_kit import serve_all

from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY
from macfleet.serve.engine import BatchEngine, EngineRequest
from macfleet.serve.prediction import parse_prediction, prediction_ids
from macfleet.serve.schemas import Limits, RequestError

MAX_TOKENS = 48
# verify(L) of a bandwidth-bound verifier (ms): the drafters' lengths follow this table, not the
# probe of whatever machine runs the suite (a loaded one measures a sawtooth that makes long
# drafts look dear), so the counts below are decided by the drafting logic alone
BANDWIDTH_BOUND = {L: 10.0 + 0.2 * (L - 1) for L in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)}


@pytest.fixture(autouse=True)
def fixed_verify_costs(monkeypatch):
    monkeypatch.setattr("macfleet.serve.engine.verify_costs", lambda model: dict(BANDWIDTH_BOUND))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny:1:64")


def _prompt(vocab: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, vocab, 12))


def _edited(answer: list[int], vocab: int) -> tuple[int, ...]:
    """The answer with a few tokens changed in its middle: a prediction an edit departs from."""
    out = list(answer)
    for i in (15, 16, 30):
        out[i] = (out[i] + 7) % vocab
    return tuple(out)


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_a_prediction_changes_no_greedy_token_and_counts_its_own_drafts(tiny, proposer):
    prompt = _prompt(tiny.vocab_size)
    [(plain, fin0)] = serve_all(BatchEngine(tiny, proposer="none"),
                                [EngineRequest(prompt, GREEDY, MAX_TOKENS)])
    assert fin0.stats.prediction_tokens == (0, 0)
    vocab = tiny.vocab_size
    useless = tuple(int(t) for t in np.random.default_rng(9).integers(0, vocab, MAX_TOKENS))
    preds = {"exact": tuple(plain), "edited": _edited(plain, vocab), "useless": useless}
    got = {name: serve_all(BatchEngine(tiny, proposer=proposer),
                           [EngineRequest(prompt, GREEDY, MAX_TOKENS, prediction=p)])[0]
           for name, p in preds.items()}
    for name, (toks, _) in got.items():
        assert toks == plain, name
    exact, edited = got["exact"][1].stats, got["edited"][1].stats
    # the exact prediction: every answer token but each block's bonus one came from it
    acc, rej = exact.prediction_tokens
    assert rej == 0 and acc >= MAX_TOKENS - exact.blocks and exact.blocks <= 6
    acc, rej = edited.prediction_tokens
    assert acc >= MAX_TOKENS - 3 * 4 - edited.blocks  # re-aligned after each edit
    assert 0 < rej <= 3 * 16
    assert edited.blocks < MAX_TOKENS // 3
    acc, rej = got["useless"][1].stats.prediction_tokens
    assert acc <= 4 and rej <= 32  # it went quiet after its misses


class ForwardClock:
    """The engine's clock, moved only by its forwards, each by BANDWIDTH_BOUND's verify(L) of
    its tokens: every time the engine measures (the cost curve, the controllers' fits) is
    the table's, so adaptive draft lengths depend on the drafting logic alone."""

    def __init__(self, monkeypatch) -> None:
        import macfleet.serve.engine as engine

        self.t, real = 0.0, engine.flat_outputs
        self.blocks: list[tuple[int, bool]] = []  # each decode segment: (positions, a tree?)

        def timed(model, segs, **kw):
            self.t += (10.0 + 0.2 * (sum(len(s.tokens) for s in segs) - 1)) / 1e3
            self.blocks += [(len(s.tokens), s.parents is not None) for s in segs
                            if s.logits_from is not None]
            return real(model, segs, **kw)

        monkeypatch.setattr(engine, "flat_outputs", timed)

    def __call__(self) -> float:
        return self.t


def _blocks(lm, proposer, prompt, prediction, monkeypatch, group=None, forwards=None):
    """(tokens, each block's (drafts asked, accepted, committed), Finished) of one request;
    forwards: a list given each verified block's (positions, a tree?)."""
    from macfleet.engine.events import BlockDone, Finished, TokensCommitted

    # the table known from the start, as on a machine that probed it once (else the
    # prediction's seeding would give the batch's cost curve a table the run without lacks)
    monkeypatch.setattr("macfleet.engine.verify_costs.known_verify_costs",
                        lambda model: dict(BANDWIDTH_BOUND))
    clock = ForwardClock(monkeypatch)
    eng = BatchEngine(lm, proposer=proposer, clock=clock)
    toks, blocks, done = [], [], []

    def emit(ev):
        if isinstance(ev, TokensCommitted):
            toks.extend(ev.tokens)
        elif isinstance(ev, BlockDone):
            blocks.append((ev.k, ev.accepted, ev.committed))
        elif isinstance(ev, Finished):
            done.append(ev)

    eng.submit(EngineRequest(prompt, GREEDY, 96, lm.eos_ids, report_blocks=True,
                             prediction=prediction),
               emit, proposer=group)
    eng.run_until_idle()
    if forwards is not None:
        forwards.extend(clock.blocks)
    return toks, blocks, done[0]


def _batch(lm, runs, prompt, monkeypatch):
    """Several requests of one prompt decoded as ONE batch of an engine of no drafter on
    BANDWIDTH_BOUND's clock: each run (its drafter's spec, its prediction) a session of its
    own; each one's (tokens, Finished). On the CPU a smollm2 forward costs about the same for
    one session or four (reading the weights), so the batch costs its longest session's
    steps, not the sum of all four's."""
    from macfleet.engine.events import Finished, TokensCommitted
    from macfleet.serve.drafting import make_drafting

    monkeypatch.setattr("macfleet.engine.verify_costs.known_verify_costs",
                        lambda model: dict(BANDWIDTH_BOUND))
    eng = BatchEngine(lm, proposer="none", clock=ForwardClock(monkeypatch), max_active=len(runs))
    evs: list[list] = [[] for _ in runs]
    for (spec, prediction), out in zip(runs, evs):
        eng.submit(EngineRequest(prompt, GREEDY, 96, lm.eos_ids, prediction=prediction),
                   out.append, proposer=make_drafting(spec, lm, eng.draft_tokens, False))
    eng.run_until_idle()
    return [([t for e in out if isinstance(e, TokensCommitted) for t in e.tokens],
             next(e for e in out if isinstance(e, Finished))) for out in evs]


@pytest.mark.slow
def test_a_useless_prediction_leaves_the_other_drafters_blocks_as_they_are(tiny, monkeypatch):
    """A prediction the answer takes nothing from (tokens it never holds) drafts beside the
    session's chain drafter without resizing it: every block asks it the same length and
    commits the same tokens as without a prediction (it was once a member of a group sized
    otherwise: 3x the blocks here). The drafter is a copy of the verifier, so each block's
    length is the adaptive length's choice alone."""
    prompt, vocab = _prompt(tiny.vocab_size), tiny.vocab_size
    plain, blocks, fin = _blocks(tiny, "draft:tiny:1:64", prompt, (), monkeypatch)
    assert fin.stats.blocks < len(plain) // 3  # long drafts, all accepted
    pool = sorted(set(range(vocab)) - set(plain) - set(prompt))
    useless = tuple(int(t) for t in np.random.default_rng(3).choice(pool, 96))
    toks, blocks_p, fin_p = _blocks(tiny, "draft:tiny:1:64", prompt, useless, monkeypatch)
    assert toks == plain
    acc, rej = fin_p.stats.prediction_tokens
    assert acc == 0 and rej > 0  # it drafted (its first block), and nothing was taken
    assert [b[0] for b in blocks_p] == [b[0] for b in blocks]
    assert blocks_p == blocks


@pytest.mark.slow
def test_a_prediction_beside_a_drafter_that_drafts_the_same_changes_no_token(tiny,
                                                                             monkeypatch):
    """The answer as the prediction beside a drafter that drafts it too (a copy of the
    verifier): their drafts share the tree's nodes, the accepted path runs through both, and
    the tokens are plain decoding's (the smollm2 test's code prediction beside n-gram, which
    copies the same code out of the prompt, checked this on the embedded model)."""
    prompt = _prompt(tiny.vocab_size)
    plain, _, _ = _blocks(tiny, "none", prompt, (), monkeypatch)
    toks, _, fin = _blocks(tiny, "draft:tiny:1:64", prompt, tuple(plain), monkeypatch)
    assert toks == plain
    assert fin.stats.prediction_tokens[0] > 0 and fin.stats.accepted > len(plain) // 2


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_a_useless_prediction_costs_no_verify_position_once_it_went_quiet(tiny, monkeypatch,
                                                                           proposer):
    """A prediction that holds every pair of the answer's consecutive tokens, each followed by
    a token the answer never has: every block's answer ends in a short match of it, and every
    draft from there misses. Once it missed QUIET_AFTER times it drafts nothing (a short
    match no longer re-aligns it; it holds no long one): every later block is the block
    without it, a chain of the same positions (no tree, no padding), and the positions it
    added are exactly its rejected tokens."""
    from macfleet.engine.proposers.prediction import QUIET_AFTER

    prompt, vocab = _prompt(tiny.vocab_size), tiny.vocab_size
    plain_fwd, pred_fwd = [], []
    plain, _, _ = _blocks(tiny, proposer, prompt, (), monkeypatch, forwards=plain_fwd)
    junk = sorted(set(range(vocab)) - set(plain) - set(prompt))
    assert junk
    rng = np.random.default_rng(5)
    useless = tuple(t for a, b in zip(plain, plain[1:])  # (junk first: not the answer's start)
                    for t in (int(rng.choice(junk)), a, b))
    toks, _, fin = _blocks(tiny, proposer, prompt, useless, monkeypatch, forwards=pred_fwd)
    assert toks == plain
    assert len(pred_fwd) == len(plain_fwd)
    differ = [i for i, (a, b) in enumerate(zip(plain_fwd, pred_fwd)) if a != b]
    assert differ == [i for i, (_, tree) in enumerate(pred_fwd) if tree]  # only its trees
    assert not any(tree for _, tree in plain_fwd)
    assert 0 < len(differ) <= QUIET_AFTER <= 4  # quiet after a few misses
    acc, rej = fin.stats.prediction_tokens
    assert acc == 0
    assert sum(pred_fwd[i][0] - plain_fwd[i][0] for i in differ) == rej


def test_a_sessions_group_is_left_as_it_is_by_a_prediction(tiny, monkeypatch):
    """The group a caller passes (a verifier agent's remote tree) keeps its drafters and node
    budget; the prediction's counts come beside theirs."""
    from macfleet.engine.proposers import make_proposer
    from macfleet.engine.proposers.group import ProposerGroup

    group = ProposerGroup([make_proposer("ngram", tiny)], node_budget=16)
    prompt = _prompt(tiny.vocab_size)
    plain, _, _ = _blocks(tiny, "none", prompt, (), monkeypatch)
    toks, _, fin = _blocks(tiny, "none", prompt, tuple(plain), monkeypatch, group=group)
    assert toks == plain
    assert [p.name for p in fin.stats.per_proposer] == [group.proposers[0].name, "prediction"]
    assert fin.stats.prediction_tokens[0] > len(plain) // 2
    assert group.node_budget == 16 and len(group.proposers) == 1


def test_a_prediction_is_refused_by_the_batch_invariant_mode_and_checked(tiny):
    prompt = _prompt(tiny.vocab_size)
    with pytest.raises(ValueError, match="prediction"):
        BatchEngine(tiny, proposer="ngram", invariant=True).submit(
            EngineRequest(prompt, GREEDY, 8, prediction=(1, 2)), lambda ev: None)
    with pytest.raises(ValueError, match="prediction"):
        BatchEngine(tiny, proposer="ngram").submit(
            EngineRequest(prompt, GREEDY, 8, prediction=(1, tiny.vocab_size)), lambda ev: None)


@pytest.mark.parametrize("v,param", [
    ("def f(): pass", "prediction"),
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": 3}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text", "text": 1}]}, "prediction.content"),
])
def test_a_bad_prediction_is_a_400_naming_the_field(v, param):
    with pytest.raises(RequestError) as e:
        parse_prediction({"prediction": v})
    assert e.value.param == param and e.value.status == 400


def test_a_prediction_as_text_parts_is_their_text_and_its_ids_are_bounded(tiny):
    parts = [{"type": "text", "text": "abc "}, {"type": "text", "text": "def"}]
    assert parse_prediction({"prediction": {"type": "content", "content": parts}}) == "abc def"
    assert parse_prediction({}) == ""
    assert prediction_ids(tiny.tokenizer, "", Limits()) == ()
    ids = prediction_ids(tiny.tokenizer, "abc def", Limits())
    assert ids and all(0 <= t < tiny.vocab_size for t in ids)
    with pytest.raises(RequestError) as e:
        prediction_ids(tiny.tokenizer, "abc def" * 10, Limits(max_prediction_tokens=8))
    assert e.value.param == "prediction.content"


SNIPPET = '''def mean(values):
    """The arithmetic mean of a non-empty list."""
    total = 0
    for v in values:
        total += v
    return total / len(values)


def spread(values):
    return max(values) - min(values)
'''


def _repeat_snippet():
    """The embedded model (skipped when absent), its tokenizer, and the request to repeat
    SNIPPET: the smollm2 tests' shared prompt."""
    from macfleet.engine.models import embedded_model_path
    from macfleet.engine.text import encode_prompt

    if embedded_model_path() is None:
        pytest.skip("the embedded model is not installed")
    lm = load_model("smollm2")
    return lm, lm.tokenizer, tuple(encode_prompt(
        lm.tokenizer, "Repeat this code exactly:\n```python\n" + SNIPPET + "```", True))


def test_drafters_count_the_tokens_of_theirs_the_cut_tree_verified():
    """A tree cut to its slot (the iteration's budget) verifies only its first nodes: each
    drafter's drafted count (the prediction's rejected tokens) is of those, not of its draft."""
    from macfleet.engine.proposers.base import Draft
    from macfleet.engine.tree import TokenTree
    from macfleet.serve.decode import verified_drafts

    drafts = [Draft((1, 2, 3)), Draft((1, 5, 6, 7, 8))]
    tree = TokenTree.from_drafts(0, [d.tokens for d in drafts]).first(5)  # root + 4 nodes
    assert [len(d) for d in verified_drafts(drafts, tree)] == [3, 2]
    assert verified_drafts(drafts, TokenTree.from_drafts(0, [d.tokens for d in drafts])) == drafts


@pytest.mark.slow  # the embedded model, five answers
def test_smollm2_predictions_change_no_token_and_the_codes_takes_fewer_verifier_steps(
        monkeypatch):
    """The embedded model asked to repeat code, on a fixed verify(L) (ForwardClock): greedy
    tokens identical to plain decoding with the code as the prediction (alone) or unrelated
    code (beside n-gram). The code's prediction is mostly
    accepted and takes under half the verifier steps; the unrelated code's (its drafts
    re-align on common runs such as indentation, and miss) takes no more blocks than n-gram
    alone. (It was asked alone too: no more blocks than plain decoding holds there by
    construction, each block committing at least the one token a plain step does; and beside
    n-gram, which drafts the same code: a drafter agreeing with the prediction is the tiny
    model's test_a_prediction_beside_a_drafter_that_drafts_the_same_changes_no_token,
    docs/testing.md ninth round.) The edited and useless predictions of tiny token ids, alone
    and beside n-gram:
    test_a_prediction_changes_no_greedy_token_and_counts_its_own_drafts."""
    lm, tok, ids = _repeat_snippet()
    code = tuple(tok.encode(SNIPPET, add_special_tokens=False))
    other = tuple(tok.encode(OTHER, add_special_tokens=False))
    # the four answers as one batch (each was its own engine's: 89 smollm2 forwards, now
    # the plain session's 40; greedy batched equals alone on smollm2:
    # test_batch.py::test_smollm2_batched_greedy_equals_alone)
    # the code's own counts with no other drafter: beside n-gram (which copies the same code
    # out of the prompt) a token both drafted is credited to one of them, and which one
    # follows n-gram's draft length
    (plain, fin), (toks, f), (ngram, fin_ng), (toks_p, fin_p) = _batch(
        lm, [("none", ()), ("none", code), ("ngram", ()), ("ngram", other)], ids, monkeypatch)
    assert toks == plain
    assert f.stats.prediction_tokens[0] >= len(plain) // 2
    assert f.stats.blocks < fin.stats.blocks // 2
    assert ngram == plain
    assert toks_p == plain
    assert fin_p.stats.prediction_tokens[1] > 0  # it drafted
    assert fin_p.stats.blocks <= fin_ng.stats.blocks


OTHER = '''class Ring:
    """A fixed-size ring buffer."""

    def __init__(self, size):
        self.items = [None] * size
        self.head = 0

    def push(self, value):
        self.items[self.head] = value
        self.head = (self.head + 1) % len(self.items)
'''


def test_a_trees_trials_are_its_own_drafters_beside_a_prediction():
    """The trials the plan of a session's lengths reads count its drafters' nodes only: a
    prediction's branch that missed is no trial of theirs."""
    from macfleet.engine.tree import TokenTree
    from macfleet.serve.decode import tree_trials

    tree = TokenTree.from_drafts(0, [(1, 2), (7, 8, 9)])  # theirs (1, 2); the prediction's
    theirs = tree.owned[0]
    assert tree_trials(tree, [1, 2]) == tree_trials(tree, [1, 2], theirs) == (2, 2)
    assert tree_trials(tree, [1]) == (2, 1)  # 2 was there and refused
    assert tree_trials(tree, []) == (1, 0)
    assert tree_trials(tree, [], theirs) == (1, 0)  # their 1 refused
    assert tree_trials(tree, [3, 4, 5], theirs) == (1, 0)  # the prediction's path: theirs missed
    empty = TokenTree.from_drafts(0, [(), (7, 8)])  # they drafted nothing
    assert tree_trials(empty, [], empty.owned[0]) == (0, 0)
    assert tree_trials(empty, []) == (1, 0)
