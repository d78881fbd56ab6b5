"""The drafting plan (engine/text.py `plan_drafting`): '+' or a tree drafter -> a token tree,
one chain drafter -> chains; through the serving engine (serve/one.py) the text stream is
flushed last, the same for in-process and agent runs.

Token ids: the "greedy margin" rule of tests/tolerance.py (a tree vs chains).
"""

from __future__ import annotations

import pytest

from macfleet.engine.events import Finished
from macfleet.engine.models import load_model
from macfleet.engine.proposers import drafts_tree
from macfleet.engine.text import TextDelta, plan_drafting
from macfleet.serve.one import generate_one


@pytest.mark.parametrize("spec,tree", [("ngram", False), ("none", False), ("eagle", False),
                                       ("eagle2", True), ("retrieval", True),
                                       ("ngram+layerskip:1", True)])
def test_tree_or_chain_is_decided_from_the_spec(spec, tree):
    assert drafts_tree(spec) is tree
    got = plan_drafting(spec, chain=lambda s: ("chain", s), tree=lambda specs: ("tree", specs))
    assert got == (("tree", spec.split("+")) if tree else ("chain", spec))


def test_local_tree_and_chain_give_the_same_text_and_flush_last():
    lm = load_model("tiny:3")
    runs = {}
    for spec in ("none", "ngram", "ngram+draft:tiny:3"):
        evs = list(generate_one(lm, "the cat sat on the mat", chat=False, proposer=spec,
                                max_tokens=24))
        fin = evs[-1]
        assert isinstance(fin, Finished)
        deltas = [e for e in evs if isinstance(e, TextDelta)]
        assert [t for d in deltas for t in d.tokens] == list(fin.token_ids)
        runs[spec] = ("".join(d.text for d in deltas), fin.token_ids)
        assert (len(fin.stats.per_proposer) == 2) is ("+" in spec)
    assert len(set(runs.values())) == 1


def test_a_drafter_of_nothing_cannot_be_a_tree_branch():
    lm = load_model("tiny:3")
    with pytest.raises(ValueError, match="drafts nothing"):
        list(generate_one(lm, "hi", chat=False, proposer="ngram+none", max_tokens=2))
