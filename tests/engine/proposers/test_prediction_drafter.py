"""The prediction drafter (OpenAI's Predicted Outputs) on its own: alignment, re-alignment
after the answer departs, draft lengths from its acceptance and verify(L), and going quiet
when the prediction stops matching."""

from __future__ import annotations

from macfleet.engine.proposers.prediction import (LONG_MATCH, MAX_WINDOW, PRIOR_ALPHA,
                                                  RUN_MIN, Acceptance, PredictionProposer,
                                                  best_window, in_run, ngram_index, realign)

PROMPT = (900, 901, 902)  # the answer starts after these
FLAT = {1: 10.0, 2: 10.0, 8: 10.0, 16: 11.0, 32: 12.0, 64: 13.0, 128: 14.0}  # a GPU's verify(L)


def _drafter(pred, costs=FLAT) -> PredictionProposer:
    p = PredictionProposer(pred, len(PROMPT))
    p.start(None)
    p.seed_verify_costs(costs)
    return p


def test_best_window_follows_acceptance_and_the_verify_curve():
    assert best_window(0.95, lambda L: 1.0, 64) == 64  # free verification: all of it
    assert best_window(0.95, lambda L: float(L), 64) == 0  # linear: never pays
    assert best_window(0.0, lambda L: 1 + 0.05 * (L - 1), 64) == 0  # never accepted
    steep = lambda L: 1 + 0.1 * (L - 1)  # noqa: E731
    assert 0 < best_window(0.8, steep, 64) < best_window(0.98, steep, 64) <= 64


def test_drafts_the_prediction_from_the_answers_start_and_follows_it():
    pred = list(range(100, 300))
    p = _drafter(pred)
    first = p.propose(PROMPT, MAX_WINDOW).tokens
    assert first == tuple(pred[:len(first)]) and len(first) >= 16  # flat curve: long drafts
    p.observe(len(first), len(first), 10.0)
    answer = pred[:len(first) + 1]  # the drafts and the bonus token, as the prediction has it
    d = p.propose((*PROMPT, *answer), MAX_WINDOW).tokens
    assert d == tuple(pred[len(answer):len(answer) + len(d)]) and len(d) >= len(first)
    assert p.propose((*PROMPT, *answer), 3).tokens == tuple(pred[len(answer):len(answer) + 3])


def test_realigns_after_an_edit_to_the_nearest_occurrence_after_the_last_position():
    # the prediction repeats a phrase: after the edit the answer continues at the SECOND one
    phrase = [7, 8, 9]
    pred = [1, 2, 3, *phrase, 40, 41, 42, 43, *phrase, 50, 51, 52, 53]
    p = _drafter(pred)
    assert p.propose(PROMPT, 4).tokens == (1, 2, 3, 7)
    p.observe(4, 4, 10.0)
    # the answer went 1 2 3 7 8 9 40 41 (prediction position 8), then an edit: 99, then the
    # phrase again -> the prediction's second phrase, followed by 50...
    answer = [1, 2, 3, 7, 8, 9, 40, 41, 99, *phrase]
    assert p.propose((*PROMPT, *answer), 8).tokens[:4] == (50, 51, 52, 53)


def test_realign_prefers_the_longest_suffix_then_the_nearest_after_the_anchor():
    pred = [5, 6, 1, 2, 9, 1, 2, 3, 7]
    index = ngram_index(pred)
    assert realign(index, [0, 1, 2, 3], anchor=0) == (8, 3)  # "1 2 3" beats "2 3"
    assert realign(index, [0, 1, 2], anchor=5) == (7, 2)  # the "1 2" at/after 5
    assert realign(index, [0, 1, 2], anchor=8) is None  # short and only behind: not trusted
    assert realign(index, [4, 4], anchor=0) is None


def test_a_useless_prediction_goes_quiet_and_a_long_match_wakes_it():
    """On a CPU's steep verify(L) drafts that miss soon cost more than they can win: the
    drafter falls silent; only a long match of the answer in the prediction wakes it."""
    steep = {L: 10.0 * (1 + 0.25 * (L - 1)) for L in (1, 2, 4, 8, 16, 32, 64)}
    pred = list(range(11, 60))
    p = _drafter(pred, steep)
    d = p.propose(PROMPT, MAX_WINDOW)
    assert 0 < len(d) < 16
    p.observe(len(d), 0, 10.0)  # a miss
    ans = [30, 31, 12, 13]  # a short match: drafts again, if it still pays
    d = p.propose((*PROMPT, *ans), MAX_WINDOW)
    assert d.tokens == tuple(pred[3:3 + len(d)])
    p.observe(len(d), 0, 10.0)  # a second miss: quiet
    assert best_window(p.alpha, p.curve.cost, MAX_WINDOW) < best_window(
        PRIOR_ALPHA, p.curve.cost, MAX_WINDOW)
    ans += [40, 41, 18, 19]  # a short match again: not trusted any more
    assert p.propose((*PROMPT, *ans), MAX_WINDOW).tokens == ()
    ans += [1, 2, *pred[20:20 + LONG_MATCH]]  # a long one: it speaks again
    assert p.propose((*PROMPT, *ans), MAX_WINDOW).tokens[:2] == tuple(pred[20 + LONG_MATCH:][:2])


def test_the_end_of_the_prediction_drafts_nothing():
    pred = [1, 2, 3]
    p = _drafter(pred)
    assert p.propose((*PROMPT, 1, 2), 8).tokens == (3,)
    assert p.propose((*PROMPT, 1, 2, 3), 8).tokens == ()
    assert p.propose((*PROMPT, 1, 2, 3, 4), 8).tokens == ()


# verify(L) of the embedded model on a 2-core CPU (ms, the probe's shape): steep enough that
# the length that pays depends on the acceptance
CPU = {1: 114.0, 2: 122.0, 4: 132.0, 8: 144.0, 12: 158.0, 16: 170.0, 24: 192.0, 32: 217.0}


def test_acceptance_counts_each_drafts_tokens_and_one_trial_where_it_was_cut_short():
    a = Acceptance(0.9)
    assert a.alpha == 0.9
    full = a.seen(8, 8)
    assert (full.accepted, full.trials) == (8, 8)
    part = full.seen(8, 3)
    assert (part.accepted, part.trials) == (11, 12)
    assert a.seen(4, 0).alpha < a.alpha < full.alpha


def test_only_a_draft_accepted_in_full_leaves_the_drafter_in_a_run():
    """... and one long enough to start a run: a useless prediction's short re-aligned
    drafts are sometimes taken by chance; inside a run, any draft taken in full goes on."""
    assert in_run(RUN_MIN, RUN_MIN)
    assert not in_run(12, 11)
    assert not in_run(0, 0)
    assert not in_run(RUN_MIN - 1, RUN_MIN - 1)
    assert in_run(RUN_MIN - 1, RUN_MIN - 1, was_in_run=True)
    assert not in_run(RUN_MIN, RUN_MIN - 1, was_in_run=True)


def test_inside_a_run_it_drafts_longer_and_a_departure_ends_the_run():
    """An answer that copies the prediction in runs between departures: drafts after a
    departure are taken in part, so the average acceptance is low; once a draft was
    accepted in full, the next is as long as the run's own acceptance pays for on this
    verify(L), not the average's; an answer that leaves the prediction ends the run, even
    right after a draft accepted in full (its bonus token departs)."""
    pred = list(range(1000, 1400))
    p = _drafter(pred, CPU)
    answer: list[int] = []
    for at in (0, 60, 120):  # three departures, each re-aligned and taken in part
        if at:
            answer += pred[at:at + 2]  # back on the prediction: re-aligned on these two
        start = at + 2 if at else 0
        d = p.propose((*PROMPT, *answer), MAX_WINDOW).tokens
        assert d[:2] == tuple(pred[start:start + 2])
        p.observe(len(d), 2, 150.0)
        answer += [*pred[start:start + 2], 7, 8]  # then the answer departs
    average = best_window(p.alpha, p.curve.cost, MAX_WINDOW)
    assert average < best_window(PRIOR_ALPHA, p.curve.cost, MAX_WINDOW)
    answer += [7, 8] + pred[200:202]  # re-aligned once more: a draft taken in full
    d = p.propose((*PROMPT, *answer), MAX_WINDOW).tokens
    assert d == tuple(pred[202:202 + average])
    p.observe(len(d), len(d), 150.0)
    answer += [*d, pred[202 + len(d)]]  # ... and its bonus token along the prediction
    run = p.propose((*PROMPT, *answer), MAX_WINDOW).tokens
    assert run == tuple(pred[203 + len(d):203 + len(d) + len(run)])
    assert len(run) == best_window(p.on_run.alpha, p.curve.cost, MAX_WINDOW)
    assert len(run) > best_window(p.alpha, p.curve.cost, MAX_WINDOW)
    assert len(d) >= RUN_MIN  # (what started the run)
    p.observe(len(run), len(run), 150.0)  # taken in full, but the bonus token departs
    answer += [*run, 5, 6, *pred[300:302]]
    after = p.propose((*PROMPT, *answer), MAX_WINDOW).tokens
    assert after[:2] == tuple(pred[302:304])
    assert len(after) < len(run)
