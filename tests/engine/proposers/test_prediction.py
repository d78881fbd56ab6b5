"""The prediction drafter (OpenAI's Predicted Outputs) on its own: alignment, re-alignment
after the answer departs, and going quiet when the prediction stops matching."""

from __future__ import annotations

from macfleet.engine.proposers.prediction import (LONG_MATCH, MIN_WINDOW, PredictionProposer,
                                                  ngram_index, realign)

PROMPT = (900, 901, 902)  # the answer starts after these


def _drafter(pred, **kw) -> PredictionProposer:
    p = PredictionProposer(pred, len(PROMPT), **kw)
    p.start(None)
    return p


def test_drafts_the_prediction_from_the_answers_start_and_follows_it():
    pred = list(range(100, 160))
    p = _drafter(pred, start_window=8)
    assert p.propose(PROMPT, 64).tokens == tuple(pred[:8])
    p.observe(8, 8, 1.0)  # all accepted: the window doubles
    answer = pred[:9]  # the 8 drafts and the bonus token, as the prediction has it
    assert p.propose((*PROMPT, *answer), 64).tokens == tuple(pred[9:25])
    assert p.propose((*PROMPT, *answer), 3).tokens == tuple(pred[9:12])  # k bounds it


def test_realigns_after_an_edit_to_the_nearest_occurrence_after_the_last_position():
    # the prediction repeats a phrase: after the edit the answer continues at the SECOND one
    phrase = [7, 8, 9]
    pred = [1, 2, 3, *phrase, 40, 41, 42, 43, *phrase, 50, 51, 52, 53]
    p = _drafter(pred, start_window=4)
    assert p.propose(PROMPT, 8).tokens == (1, 2, 3, 7)
    p.observe(4, 4, 1.0)
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


def test_a_useless_prediction_goes_quiet_after_misses_and_a_long_match_wakes_it():
    pred = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
    p = _drafter(pred, start_window=16)
    assert len(p.propose(PROMPT, 64)) == 16
    p.observe(16, 0, 1.0)  # a miss
    ans = [30, 31, 12, 13]  # a short match: drafts again, fewer
    d = p.propose((*PROMPT, *ans), 64)
    assert d.tokens == (14, 15, 16, 17)
    p.observe(len(d), 0, 1.0)  # a second miss: quiet
    assert p.window == MIN_WINDOW
    ans += [40, 41, 18, 19]  # a short match again: not trusted any more
    assert p.propose((*PROMPT, *ans), 64).tokens == ()
    ans += list(pred[3:3 + LONG_MATCH])  # a long one: it speaks again, within its window
    assert p.propose((*PROMPT, *ans), 64).tokens == tuple(pred[3 + LONG_MATCH:][:MIN_WINDOW])


def test_the_end_of_the_prediction_drafts_nothing():
    pred = [1, 2, 3]
    p = _drafter(pred)
    assert p.propose((*PROMPT, 1, 2), 8).tokens == (3,)
    assert p.propose((*PROMPT, 1, 2, 3), 8).tokens == ()
    assert p.propose((*PROMPT, 1, 2, 3, 4), 8).tokens == ()
