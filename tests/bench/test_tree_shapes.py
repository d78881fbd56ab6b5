"""`bench tree-shapes`, the pure parts: a best-N tree's greedy acceptance, shapes, the best-N tree
of a head's candidates (the bench end to end: tests/engine/proposers/eagle/test_tree_draft.py)."""

from __future__ import annotations

import math

import pytest

from macfleet.bench.store_curve import accepted_in_tree
from macfleet.bench.tree_shapes import TreeShape
from macfleet.engine.proposers.eagle.tree import TreeCandidates


def accepted_depth(tokens, parents, truth):
    """A whole tree (a head's best-N, parents before children) as the bench scores it."""
    return accepted_in_tree(tokens, parents, range(len(tokens)), truth)


def test_a_tree_accepts_its_longest_path_of_the_verifiers_tokens():
    #        root
    #       /    \
    #      5      7
    #     / \     |
    #    6   8    9
    #    |
    #    2
    tokens, parents = [5, 7, 6, 8, 9, 2], [-1, -1, 0, 0, 1, 2]
    assert accepted_depth(tokens, parents, [5, 6, 2, 4]) == 3
    assert accepted_depth(tokens, parents, [5, 8, 1]) == 2
    assert accepted_depth(tokens, parents, [7, 9]) == 2
    assert accepted_depth(tokens, parents, [7, 6, 2]) == 1  # 6 is not 7's child
    assert accepted_depth(tokens, parents, [3]) == 0
    assert accepted_depth(tokens, parents, [5]) == 1  # the truth ends: no deeper match
    assert accepted_depth([], [], [1, 2]) == 0


def test_the_n_best_candidates_form_a_tree_and_parents_follow_them():
    # depth 1: a (p .6), b (.3); depth 2 under a: c (.5), d (.05); under b: e (.2)
    c = TreeCandidates(tokens=(10, 11, 12, 13, 14),
                       scores=tuple(map(math.log, (.6, .3, .3, .03, .06))),
                       parents=(-1, -1, 0, 0, 1), depths=(1, 1, 2, 2, 2))
    assert c.ranked()[:3] == [0, 1, 2]  # a tie (.3) goes to the shallower node
    assert c.best(3) == ((10, 11, 12), (-1, -1, 0))
    toks, parents = c.best(4)
    assert toks == (10, 11, 12, 14) and parents == (-1, -1, 0, 1)
    assert c.best(0) == ((), ())


def test_tree_shapes_parse_and_refuse_nonsense():
    assert TreeShape.parse("4,5,4096") == TreeShape(4, 5, 4096)
    assert TreeShape.parse("3,7,0").name == "top3 depth7 deepall"
    for bad in ("4,5", "a,b,c", "0,5,10", "4,5,-1"):
        with pytest.raises(ValueError, match="TOP_K"):
            TreeShape.parse(bad)
