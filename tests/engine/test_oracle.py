"""The oracle proposer (bench/oracle.py): it drafts the reference at the context's
position, so a run on its own answer accepts every draft; a departure is found and followed."""

from __future__ import annotations

from macfleet.bench.overhead import follow_reference
from macfleet.engine.controller import FixedDraftLength
from macfleet.engine.events import BlockDone, Finished
from reference_loops import speculative_generate
from macfleet.bench.oracle import OracleProposer
from macfleet.engine.verifier import Verifier

PROMPT = [3, 14, 15, 9, 26, 5]


def test_it_drafts_the_reference_at_the_context_position():
    o = OracleProposer([1, 2, 3, 4, 5, 6, 7])
    o.start()
    assert o.propose([1, 2], 3).tokens == (3, 4, 5)
    assert o.propose([1, 2, 3], 2).tokens == (4, 5)
    assert o.propose([1, 2, 3, 4, 5, 6], 4).tokens == (7,)  # the reference ends
    assert o.propose([1, 2, 3, 4, 5, 6, 7], 4).tokens == ()
    assert o.departures == 0


def test_a_context_off_the_reference_gets_no_draft_and_is_counted():
    o = OracleProposer([1, 2, 3, 4, 5])
    o.start()
    assert o.propose([1, 2, 9], 2).tokens == ()  # the verifier committed 9, not 3
    assert o.propose([1, 2, 9, 7], 2).tokens == ()
    assert (o.departures, o.first_departure) == (2, 3)
    o.start()
    assert (o.departures, o.first_departure) == (0, None)


def _run(model, reference, k, n):
    blocks = []
    fin = None
    for ev in speculative_generate(Verifier(model), OracleProposer([*PROMPT, *reference])
                                   if reference is not None else None, PROMPT, max_tokens=n,
                                   controller=FixedDraftLength(k)):
        if isinstance(ev, BlockDone):
            blocks.append(ev)
        elif isinstance(ev, Finished):
            fin = ev
    return list(fin.token_ids), blocks, fin.stats


def test_on_its_own_answer_every_draft_is_accepted_in_full_blocks(tiny):
    plain, _, _ = _run(tiny.model, None, 0, 24)
    for k in (1, 3, 7):
        out, blocks, st = _run(tiny.model, plain, k, 24)
        assert out == plain
        assert st.drafted == st.accepted > 0
        # every block but a last, shortened one commits k + 1 tokens
        assert [b.committed for b in blocks[:-1]] == [k + 1] * (len(blocks) - 1)
        assert len(blocks) == -(-24 // (k + 1))


def test_a_wrong_reference_costs_speed_not_output_and_is_followed_to_the_runs_own(tiny):
    plain, _, _ = _run(tiny.model, None, 0, 20)
    wrong = list(plain)
    wrong[5] = (wrong[5] + 1) % tiny.vocab_size
    out, _, st = _run(tiny.model, wrong, 3, 20)
    assert out == plain and st.accepted < st.drafted  # greedy output is the verifier's
    trace = follow_reference(lambda ref: _run(tiny.model, ref, 3, 20)[0], wrong)
    assert trace.departures == (5,) and trace.converged and trace.runs == 2
    assert list(trace.reference) == plain
