"""The pure iteration scheduler: decoders first, drafts cut before anyone starves, chunks."""

from __future__ import annotations

import pytest

from macfleet.engine.prefix import common_prefix
from macfleet.serve.scheduler import (COST_WINDOW, DraftView, IterationCost, PrefixCopy,
                                      PrefixView, SessionView, Slot, StallControl,
                                      draft_acceptance, plan_drafts, plan_iteration,
                                      plan_prefix_sharing)


def test_decoders_first_then_prefill_chunk_under_budget():
    views = [SessionView(1, 0, want=5), SessionView(2, 300), SessionView(3, 0, want=3),
             SessionView(4, 50)]
    slots = plan_iteration(views, 64)
    assert slots[:2] == (Slot(1, 5, False), Slot(3, 3, False))
    # two prompts share the 56 left: the oldest half, the other the rest
    assert slots[2:] == (Slot(2, 28, True), Slot(4, 28, True))
    assert sum(s.tokens for s in slots) == 64
    # one prompt alone takes all that is left
    slots = plan_iteration([SessionView(1, 0, want=5), SessionView(2, 300)], 64)
    assert slots == (Slot(1, 5, False), Slot(2, 59, True))


def test_a_chat_turn_behind_a_long_prompt_goes_first_but_the_long_one_keeps_moving():
    # an 8,000-token document prefilling at 16 tokens an iteration; two chat turns arrive
    long, chat, chat2 = SessionView(1, 7000), SessionView(2, 111), SessionView(3, 40)
    slots = plan_iteration([SessionView(9, 0), long, chat, chat2], 17)
    assert slots == (Slot(9, 1, False), Slot(1, 8, True), Slot(3, 8, True))  # shortest first
    # alone the oldest gets everything; what the others leave returns to it
    assert plan_iteration([long, SessionView(2, 3)], 16) == (Slot(1, 13, True),
                                                              Slot(2, 3, True))
    # a burst of equal prompts with nothing decoding: in arrival order, as many as fit
    burst = [SessionView(i, 100) for i in range(4)]
    assert plan_iteration(burst, 256) == (Slot(0, 100, True), Slot(1, 100, True),
                                          Slot(2, 56, True))
    # how long the chat turn waits: 111 tokens at 8 an iteration, 14 iterations, not the
    # document's ~440
    n, left = 0, 111
    while left > 0:
        sl = plan_iteration([SessionView(9, 0), SessionView(1, 7000), SessionView(2, left)], 17)
        left -= next(x.tokens for x in sl if x.sid == 2)
        n += 1
    assert n == 14


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


def test_stall_control_follows_the_measured_cost():
    c = StallControl(ratio=2.0, min_chunk=8)
    assert c.budget(8, 256) == 16  # nothing measured: a small probe chunk
    assert c.budget(0, 256) == 256  # no decoder would wait
    c.observe(0, 8, 100.0)  # decode-only iterations: 100 ms
    c.observe(16, 8, 160.0)  # a 16-token chunk: 160 ms, under the 200 ms target
    assert c.chunk == 20  # grows, at most 1.5x (200/160 = 1.25)
    c.observe(20, 8, 800.0)  # the context grew: too slow now
    assert c.chunk == 8  # shrinks to target/measured, not below min_chunk
    c.observe(40, 8, 100.0)
    assert c.chunk == 60 and c.budget(8, 40) == 40  # the token budget still caps it
    off = StallControl(ratio=0)
    assert off.budget(8, 256) == 256


# this CPU's verify(L) (results/verify_l_sweep.json, rounded): a sawtooth, 16 costs what 4 does
SAWTOOTH = {1: 39.0, 2: 47.0, 3: 56.0, 4: 72.6, 6: 69.0, 8: 73.0, 12: 110.0, 16: 73.5,
            20: 108.0, 24: 120.0, 32: 103.0}


def test_chunks_are_read_off_the_cost_curve_into_its_cheap_lengths():
    from macfleet.engine.tree_budget import VerifyCurve
    from macfleet.serve.scheduler import curve_chunk

    curve = VerifyCurve()
    curve.seed(SAWTOOTH)
    # 4 decoders: 5..9 tokens and 15..18 cost at most 1.25x verify(4); 10..14 more
    assert curve_chunk(curve, 4, 1.25, 512) == 14
    assert curve_chunk(curve, 4, 1.5, 512) == 29  # 33 tokens: 108 ms past the valley at 32
    assert curve_chunk(curve, 4, 1.25, 6) == 5  # within the room left
    assert curve_chunk(curve, 4, 1.0, 512) == 3  # 5..7 tokens are cheaper than 4
    c = StallControl(ratio=1.25, min_chunk=8, curve=curve)
    assert c.budget(4, 256) == 4 + 14  # no failed chunk needed to find it
    assert c.budget(16, 256) == 16 + 8  # nothing fits: min_chunk, so a prompt still moves
    # a burst: 12 sessions wait behind 4 decoding ones: 3x the stall serves them sooner
    assert c.budget(4, 256, waiting=12, decoding=4) == 4 + curve_chunk(curve, 4, 3.75, 252)
    assert c.budget(4, 256, waiting=1, decoding=4) == 4 + 14  # one prompt: the ratio as set
    c.observe(0, 4, 72.6)  # decode-only: as the curve says
    for _ in range(8):  # chunk iterations measured twice as slow as the curve predicts
        c.observe(14, 4, 2 * 90.75)
    assert 1.5 < c.fit <= 2.0 and c.budget(4, 256) == 4 + 8  # nothing fits: min_chunk


def test_drafts_get_what_the_prompts_leave_of_the_stall_budget():
    from macfleet.serve.scheduler import draft_room

    assert draft_room(budget=20, decoding=4, prefill_left=10) == 6
    assert draft_room(budget=20, decoding=4, prefill_left=2000) == 0  # a long prompt: none
    assert draft_room(budget=3, decoding=4, prefill_left=0) == 0


def test_one_budget_an_iteration_read_by_the_drafting_plan_and_the_scheduler():
    from macfleet.serve.scheduler import IterationBudget, iteration_budget

    # no prompt waits (or the iteration is not stall-controlled): the cap, drafts unbounded
    free = iteration_budget(256, 4, 0, None, 1.5)
    assert free == IterationBudget(256, 256, None, 1.5)
    assert free.with_fixed_drafts(40) == 256  # fixed drafts are in the tokens already
    # a prompt waits: the stall control's 20 tokens, the prompt's first, the drafts' share after
    b = iteration_budget(256, 4, 10, 20, 1.5)
    assert (b.tokens, b.drafts) == (20, 6)
    assert b.with_fixed_drafts(12) == 32  # fixed-length drafts ride on top, uncut ...
    assert iteration_budget(24, 4, 10, 20, 1.5).with_fixed_drafts(12) == 24  # ... to the cap


def test_prefix_sharing_copies_what_a_cache_holds_and_waits_for_a_longer_one():
    sys_turn = tuple(range(100, 124))  # a chat template's system turn: 24 tokens
    a = PrefixView(1, (*sys_turn, 1, 2, 3, 4), (*sys_turn, 1, 2, 3, 4))  # decoding: cached
    b = PrefixView(2, (), (*sys_turn, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14))  # new
    c = PrefixView(3, (), (*sys_turn, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14))  # new, same as b
    d = PrefixView(4, (), (9,) * 30)  # new, nothing in common
    copies, waiting = plan_prefix_sharing([a, b, c, d])
    # b copies the system turn from a; c would copy 24 now, but b (ahead of it) is about to
    # hold 34 of its tokens: c waits; d has nobody to share with
    assert copies == (PrefixCopy(2, 1, 24),) and waiting == {3}
    # next iteration b holds its prompt: c copies all of it
    b2 = PrefixView(2, b.target, b.target)
    assert plan_prefix_sharing([a, b2, c, d]) == ((PrefixCopy(3, 2, 34),), frozenset())


def test_prefix_sharing_never_blocks_the_first_and_ignores_short_prefixes():
    same = tuple(range(40))
    views = [PrefixView(i, (), same) for i in range(4)]
    copies, waiting = plan_prefix_sharing(views)
    assert copies == () and waiting == {1, 2, 3}  # 0 prefills, the others wait for it
    short = [PrefixView(1, (1, 2, 3), (1, 2, 3)), PrefixView(2, (), (1, 2, 3, 4, 5))]
    assert plan_prefix_sharing(short, min_shared=8) == ((), frozenset())
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2 and common_prefix((), (1,)) == 0


def _line(a: float, b: float):
    return lambda n: a + b * (n - 1)


def test_draft_plan_pays_alone_but_only_for_likely_drafts_in_a_wide_batch():
    # alone: verify(1) 50 ms, each extra row 3 ms: likely drafts all pay; at alpha 0.5 the
    # 3rd raises the block's tokens per ms by 1.7% (1.875 / 59 against 1.75 / 56), under the
    # 2% margin, and the 4th lowers it
    assert plan_drafts([DraftView(1, 0.8, 4)], _line(50, 3)) == {1: 4}
    assert plan_drafts([DraftView(1, 0.5, 4)], _line(50, 3)) == {1: 2}
    # 16 sessions: the forward costs 100 ms for 16 tokens; a draft row costs 3.5 ms and pays
    # only when accepted more often than ~16/100 * 3.5 = 0.56 of the time
    wide = _line(100 - 15 * 3.5, 3.5)
    views = [DraftView(i, 0.3, 4) for i in range(15)] + [DraftView(15, 0.9, 4)]
    ks = plan_drafts(views, wide)
    assert all(ks[i] == 0 for i in range(15)) and ks[15] >= 3
    # a probing session gets one draft whatever it costs; a fixed want caps everything
    ks = plan_drafts([DraftView(1, 0.05, 4, probe=True), DraftView(2, 0.99, 2)], wide)
    assert ks == {1: 1, 2: 2}
    assert plan_drafts([], wide) == {}


def test_draft_plan_reads_a_sawtooth_curve_and_shared_drafting_steps():
    # the CPU's flat batch (measured: 4 rows 84 ms, 8 82, 12 110, 16 102, 24 131): 4 sessions'
    # first drafts ride free; their third ones would land on the 12-row tooth, and going on
    # to 16 rows needs drafts too unlikely to pay for it
    table = {4: 84.0, 8: 82.0, 12: 110.0, 16: 102.0, 24: 131.0}

    def saw(n):
        return table[min(k for k in table if k >= n)]

    views = [DraftView(i, 0.5, 4) for i in range(4)]
    assert plan_drafts(views, saw) == {i: 1 for i in range(4)}
    # a line through the same points would have taken more (or fewer): the curve decides
    assert sum(plan_drafts(views, _line(80, 2.0)).values()) > 4
    # drafted together, a position costs step_ms once for all sessions, not per session:
    # at 30 ms a step, 4 sessions at alpha 0.5 take one draft each (6 tokens in 82 + 30 ms
    # against 4 in 84); drafted one by one at 30 ms a token, none (4.5 in 82 + 30 is worse)
    shared = [DraftView(i, 0.5, 1, draft_ms=30.0, together=True) for i in range(4)]
    alone = [DraftView(i, 0.5, 1, draft_ms=30.0) for i in range(4)]
    assert plan_drafts(shared, saw, step_ms=30.0) == {i: 1 for i in range(4)}
    assert plan_drafts(alone, saw) == {i: 0 for i in range(4)}


def test_draft_plan_keeps_others_waiting_within_the_stall_ratio():
    # one core, ~5 ms a row: 4 sessions whose drafts are accepted 0.9 of the time would take
    # 4 each (4 + 16 rows: 180 ms against 100 without drafts); each of them makes the three
    # others wait, so under a stall ratio of 1.25 the iteration stays within 125 ms
    line = _line(85, 5.0)
    views = [DraftView(i, 0.9, 4) for i in range(4)]
    free = plan_drafts(views, line)
    assert sum(free.values()) == 16
    capped = plan_drafts(views, line, stall_ratio=1.25)
    n = sum(capped.values())
    assert 0 < n < 16 and line(4 + n) <= 1.25 * line(4) < line(4 + n + 1)
    # a session alone makes nobody wait: its drafts are its own trade
    assert plan_drafts([DraftView(1, 0.9, 8)], line, stall_ratio=1.25) == {1: 8}
    # the bound counts drafting time too (it delays everyone as much as the forward)
    slow = [DraftView(i, 0.9, 4, draft_ms=4.0) for i in range(4)]
    assert sum(plan_drafts(slow, line, stall_ratio=1.25).values()) < n


def test_draft_acceptance_leans_on_the_pool_until_a_session_has_its_own_data():
    assert draft_acceptance(0, 0, 0, 0) == pytest.approx(0.5)  # nothing known: 1/2
    low_pool = draft_acceptance(0, 0, 2, 100)
    assert low_pool < 0.05
    assert draft_acceptance(40, 50, 2, 100) > 0.7  # a session with a repetitive stretch


def test_iteration_cost_fits_a_line_and_keeps_the_slope_without_spread():
    c = IterationCost()
    assert c.predict(16) is None
    for n in (16, 20, 24, 16, 32):
        c.observe(n, 40 + 3.5 * n)
    assert c.b == pytest.approx(3.5) and c.predict(16) == pytest.approx(96)
    for _ in range(COST_WINDOW):  # the batch settles at 16 tokens, now 10 ms slower: no
        c.observe(16, 106)  # spread left to fit, the last slope is kept, the level follows
    assert c.b > 2 and c.predict(16) == pytest.approx(106)
