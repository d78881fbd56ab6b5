"""The serving engine's step ahead: a batch of plain steps dispatches its next iteration on the
lazy tokens of this one before reading it (serve/engine.py, the decision `steps_ahead` in
serve/scheduler.py). What a stop token, a length, a cancel or a new arrival at an iteration
that went out ahead does must be what the engine without the step ahead does: the same events,
the same tokens, the same cache offsets at every event and the same KV kept."""

from __future__ import annotations

import numpy as np
import pytest

from macfleet.engine.events import Finished, TokensCommitted
from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.serve import decode as decode_mod
from macfleet.serve import engine as engine_mod
from macfleet.serve.engine import BatchEngine, EngineRequest
from macfleet.serve.logprobs import LogprobsCommitted
from macfleet.serve.scheduler import AheadView, steps_ahead

MODEL = "tiny:3"


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


# -- the decision (pure) ---------------------------------------------------------------------
def plain(sid: int, **kw) -> AheadView:
    return AheadView(sid, True, **kw)


def test_plain_steps_go_ahead_and_sessions_ending_here_stay_out():
    assert steps_ahead([plain(0), plain(1, left=3)]) == (0, 1)
    assert steps_ahead([plain(0, left=0), plain(1), plain(2, cancelled=True)]) == (1,)
    assert steps_ahead([plain(0, left=0)]) == ()
    assert steps_ahead([]) == ()


@pytest.mark.parametrize("other", [AheadView(1, False), plain(1, drafts=True),
                                   plain(1, grammar=True)])
def test_one_session_decided_on_the_host_keeps_the_batch_in_step(other):
    """A prompt chunk, an install, a draft or a grammar's mask is planned from what the host
    reads: the whole batch waits for it (the next iteration is one forward)."""
    assert steps_ahead([plain(0), other]) == ()


def test_a_waiting_request_joins_the_next_iteration():
    assert steps_ahead([plain(0)], waiting=1, room=1) == ()
    assert steps_ahead([plain(0), plain(1, left=0)], waiting=1, room=0) == ()  # freed by length
    assert steps_ahead([plain(0), plain(1, cancelled=True)], waiting=1, room=0) == ()
    assert steps_ahead([plain(0), plain(1)], waiting=2, room=0) == (0, 1)  # no room: no change
    assert steps_ahead([plain(0)], waiting=0, room=3) == (0,)


# -- the engine, with and without the step ahead ---------------------------------------------
def _prompts(vocab: int, n: int, seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, vocab, size=int(rng.integers(2, 40))).tolist())
            for _ in range(n)]


def serve(lm, reqs, *, ahead: bool, during=None, prompt_cache_bytes: int = 0):
    """(engine, each request's events, the session's cache offset at each of its events);
    `during(i, ev, submit, handles)` runs at each event (a cancel, a new arrival)."""
    eng = BatchEngine(lm, proposer="none", step_ahead=ahead, token_budget=64,
                      prompt_cache_bytes=prompt_cache_bytes)
    events: dict[int, list] = {}
    offsets: dict[int, list] = {}
    handles: list = []

    def submit(r):
        i = len(handles)
        events[i], offsets[i] = [], []

        def emit(ev):
            s = next((s for s in eng.table.active if s.sid == handles[i].sid), None)
            events[i].append(ev)
            offsets[i].append(None if s is None or s.cache is None else s.cache.offset)
            if during is not None:
                during(i, ev, submit, handles)
        handles.append(eng.submit(r, emit))

    for r in reqs:
        submit(r)
    eng.run_until_idle()
    return eng, events, offsets


def _clean(events):
    """Events without their timings (BlockDone's, Finished's statistics)."""
    return {i: [e for e in evs if isinstance(e, TokensCommitted)] + [
        (e.token_ids, e.stats.finish_reason) for e in evs if isinstance(e, Finished)]
        for i, evs in events.items()}


def answers(events):
    return {i: next(e for e in evs if isinstance(e, Finished)).token_ids
            for i, evs in events.items() if any(isinstance(e, Finished) for e in evs)}


def alike(a, b) -> None:
    """Two engines' runs: the same events, the same cache offsets at every event, the same KV
    kept in their prompt caches."""
    assert _clean(a[1]) == _clean(b[1])
    assert a[2] == b[2]
    pa, pb = a[0].prompt_cache, b[0].prompt_cache
    if pa is not None:
        ka, kb = list(pa._entries.values()), list(pb._entries.values())
        assert [e.tokens.tolist() for e in ka] == [e.tokens.tolist() for e in kb]
        for ea, eb in zip(ka, kb):
            for (k1, v1), (k2, v2) in zip(ea.kv, eb.kv):
                assert np.array_equal(np.array(k1), np.array(k2))
                assert np.array_equal(np.array(v1), np.array(v2))


@pytest.fixture
def went(monkeypatch):
    """Each `steps_ahead` decision the engines take."""
    out, real = [], engine_mod.steps_ahead
    monkeypatch.setattr(engine_mod, "steps_ahead",
                        lambda *a, **kw: out.append(real(*a, **kw)) or out[-1])
    return out


def test_one_request_is_the_engine_without_the_step_ahead(lm, went):
    reqs = [EngineRequest(p, GREEDY, 24) for p in _prompts(lm.vocab_size, 1, 0)]
    a = serve(lm, reqs, ahead=True)
    assert sum(bool(g) for g in went) == 23  # every step but the last went out ahead
    alike(a, serve(lm, reqs, ahead=False))
    assert [len(t) for t in answers(a[1]).values()] == [24]


def _stop_at(lm, prompt, at: int) -> frozenset[int]:
    """A stop token that greedy decoding of `prompt` first reaches at output position >= at."""
    ids = answers(serve(lm, [EngineRequest(prompt, GREEDY, 40)], ahead=False)[1])[0]
    return frozenset({next(t for t in ids[at:] if t not in ids[:at])})


@pytest.mark.slow
def test_a_stop_token_at_a_step_that_went_ahead_drops_it_and_rolls_the_cache_back(lm, went):
    p = _prompts(lm.vocab_size, 3, 1)
    reqs = [EngineRequest(p[0], GREEDY, 40, eos_ids=_stop_at(lm, p[0], 6)),  # stops mid-run
            EngineRequest(p[1], GREEDY, 17),  # ends by its length
            EngineRequest(p[2], GREEDY, 30)]
    went.clear()
    a = serve(lm, reqs, ahead=True, prompt_cache_bytes=1 << 24)
    assert sum(bool(g) for g in went) > 20
    alike(a, serve(lm, reqs, ahead=False, prompt_cache_bytes=1 << 24))
    fin = a[1][0][-1]
    assert fin.stats.finish_reason == "stop" and len(fin.token_ids) < 40
    assert len(a[0].prompt_cache) == 3


def test_seeded_draws_are_the_same_ahead_or_not_and_alone(lm, went):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    reqs = [EngineRequest(x, sp, 25, eos_ids=frozenset({1, 2, 3}))
            for x in _prompts(lm.vocab_size, 3, 2)]
    a = serve(lm, reqs, ahead=True)
    assert any(went)
    alike(a, serve(lm, reqs, ahead=False))
    alone = [answers(serve(lm, [r], ahead=True)[1])[0] for r in reqs]
    assert list(answers(a[1]).values()) == alone


def test_a_cancel_at_a_step_that_went_ahead_drops_its_step(lm, went):
    p = _prompts(lm.vocab_size, 2, 3)
    reqs = [EngineRequest(p[0], GREEDY, 30), EngineRequest(p[1], GREEDY, 30)]

    def during(i, ev, submit, handles):
        if i == 0 and isinstance(ev, TokensCommitted) and ev.block == 5:
            handles[0].cancel()

    a = serve(lm, reqs, ahead=True, during=during)
    assert any(went)
    alike(a, serve(lm, reqs, ahead=False, during=during))
    assert len([e for e in a[1][0] if isinstance(e, TokensCommitted)]) == 5  # nothing after
    assert len(answers(a[1])[1]) == 30
    assert a[0].kv_store.open_rows == 0 and a[0]._ahead is None


def test_a_request_arriving_at_a_step_that_went_ahead_is_answered_alike(lm, went):
    p = _prompts(lm.vocab_size, 3, 4)
    late = EngineRequest(p[2], GREEDY, 12)

    def during(i, ev, submit, handles):
        if i == 0 and isinstance(ev, TokensCommitted) and ev.block == 4:
            submit(late)

    reqs = [EngineRequest(p[0], GREEDY, 20), EngineRequest(p[1], GREEDY, 20)]
    a = serve(lm, reqs, ahead=True, during=during)
    assert any(went)
    b = serve(lm, reqs, ahead=False, during=during)
    got = answers(a[1])
    assert sorted(got) == [0, 1, 2] and got == answers(b[1])
    assert got[2] == answers(serve(lm, [late], ahead=False)[1])[0]


def test_requested_logprobs_are_built_with_their_step_not_at_its_read(lm, went, monkeypatch):
    """Requests asking for logprobs step ahead too: their rows are built with their decisions,
    before the next step goes out behind them (built at the read, they would be queued behind
    that step, and the read would wait for it), and are the engine's without the step ahead."""
    reading, at_read = [False], []
    real_read, real_rows = engine_mod.read_iteration, decode_mod.row_logprobs

    def read(*a, **kw):
        reading[0] = True
        try:
            return real_read(*a, **kw)
        finally:
            reading[0] = False

    monkeypatch.setattr(engine_mod, "read_iteration", read)
    monkeypatch.setattr(decode_mod, "row_logprobs",
                        lambda *a: at_read.append(reading[0]) or real_rows(*a))
    reqs = [EngineRequest(p, GREEDY, 16, logprobs=2) for p in _prompts(lm.vocab_size, 2, 5)]
    a = serve(lm, reqs, ahead=True)
    assert sum(bool(g) for g in went) > 10
    assert at_read and not any(at_read)
    b = serve(lm, reqs, ahead=False)
    alike(a, b)

    def logprobs(run):
        return {i: [e for e in evs if isinstance(e, LogprobsCommitted)]
                for i, evs in run[1].items()}

    assert logprobs(a) == logprobs(b) and all(len(v) == 16 for v in logprobs(a).values())
