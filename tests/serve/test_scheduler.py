"""The pure iteration scheduler: decoders first, drafts cut before anyone starves, chunks."""

from __future__ import annotations

import pytest

from macfleet.serve.scheduler import (SessionView, Slot, fit_iteration_cost, plan_iteration,
                                      stall_budget)


def test_decoders_first_then_prefill_chunk_under_budget():
    views = [SessionView(1, 0, want=5), SessionView(2, 300), SessionView(3, 0, want=3),
             SessionView(4, 50)]
    slots = plan_iteration(views, 64)
    assert slots[:2] == (Slot(1, 5, False), Slot(3, 3, False))
    assert slots[2] == Slot(2, 56, True) and len(slots) == 3  # budget used up
    assert sum(s.tokens for s in slots) == 64


def test_drafts_are_cut_but_every_decoder_runs():
    views = [SessionView(i, 0, want=9) for i in range(6)]
    slots = plan_iteration(views, 10)
    assert [s.tokens for s in slots] == [5, 1, 1, 1, 1, 1]
    slots = plan_iteration(views, 3)  # fewer tokens than decoders: all still get one
    assert [s.tokens for s in slots] == [1] * 6


def test_unchunked_prefill_takes_the_whole_prompt():
    slots = plan_iteration([SessionView(1, 0), SessionView(2, 2000)], 64, chunked=False)
    assert slots == (Slot(1, 1, False), Slot(2, 2000, True))


def test_aligned_chunks_end_on_multiples_and_are_never_starved():
    slots = plan_iteration([SessionView(1, 0), SessionView(2, 900, prefill_done=100)], 64,
                           align=512)
    assert slots[1] == Slot(2, 412, True)  # up to 512: the chunk a session alone would run
    slots = plan_iteration([SessionView(2, 900), SessionView(3, 600)], 600, align=512)
    assert slots == (Slot(2, 512, True),)  # one overrunning chunk per iteration


def test_bad_budget():
    with pytest.raises(ValueError):
        plan_iteration([], 0)


def test_iteration_cost_fit_and_stall_budget():
    samples = [(n, 50.0 + 4.0 * n) for n in (8, 8, 40, 100, 8, 256)]
    a, b = fit_iteration_cost(samples)
    assert (round(a, 6), round(b, 6)) == (50.0, 4.0)
    assert fit_iteration_cost(samples[:3]) is None  # too few to trust
    assert fit_iteration_cost([(8, 50.0)] * 6) is None  # one size: no slope
    # 8 decode tokens cost 82 ms; within 2x (164 ms) fit (164 - 50) / 4 = 28 tokens in all
    assert stall_budget(8, (a, b), 256, ratio=2.0, min_chunk=4) == 28
    assert stall_budget(8, (a, b), 256, ratio=2.0, min_chunk=30) == 38  # a prompt still moves
    assert stall_budget(8, (a, 0.0), 256) == 256  # free tokens (a GPU): the budget rules
    assert stall_budget(0, (a, b), 256) == 256
    assert stall_budget(8, None, 256, min_chunk=16) == 24  # unmeasured: a small probe chunk
    assert stall_budget(8, (a, b), 256, ratio=0) == 256  # off
    assert stall_budget(8, (a, b), 20, ratio=2.0, min_chunk=4) == 20  # never above the budget
