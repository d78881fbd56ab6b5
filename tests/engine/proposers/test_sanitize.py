"""The draft sanitizer (proposers/base.py `sanitize_draft`): what of a drafter's draft every
decode takes, exactly (issue 36: what mutants showed no test pinned), for chains and trees."""

from __future__ import annotations

import numpy as np

from macfleet.engine.proposers import Draft
from macfleet.engine.proposers.base import sanitize_draft


def test_sanitize_keeps_valid_token_ids_and_the_drafts_timing():
    assert sanitize_draft(Draft((0, 63, 5)), 8, 64).tokens == (0, 63, 5)
    assert sanitize_draft(Draft((np.int64(2), np.int32(7))), 8, 64).tokens == (2, 7)
    d = sanitize_draft(Draft((np.int64(2), np.int64(70))), 8, 64)
    assert d.tokens == (2,) and type(d.tokens[0]) is int
    cut = sanitize_draft(Draft((1, 64, 2), draft_ms=2.5), 8, 64)
    assert (cut.tokens, cut.draft_ms) == ((1,), 2.5)
    assert sanitize_draft(Draft((1, -1, 2)), 8, 64).tokens == (1,)
    assert sanitize_draft(Draft((1, 2.0, 2)), 8, 64).tokens == (1,)
    same = Draft((1, 2), draft_ms=1.5)
    assert sanitize_draft(same, 8, 64) is same


def test_sanitize_keeps_a_pmf_and_drops_each_kind_of_bad_probabilities():
    good = np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    kept = sanitize_draft(Draft((1, 2), good), 8, 4)
    assert kept.probs.dtype == np.float64
    np.testing.assert_array_equal(kept.probs, good)  # zeros are a pmf (a top-p draft)
    extra = np.vstack([good, [np.nan, 0, 0, 0]])  # rows past the drafts are not read
    np.testing.assert_array_equal(sanitize_draft(Draft((1, 2), extra), 8, 4).probs, good)
    np.testing.assert_array_equal(sanitize_draft(Draft((1, 2), good), 1, 4).probs, good[:1])
    near = good.astype(np.float64) * (1 + 5e-4)  # within the tolerance
    np.testing.assert_array_equal(sanitize_draft(Draft((1, 2), near), 8, 4).probs, near)
    bad = {
        "a list": good.tolist(),
        "3-d": good[:, None, :],
        "another vocabulary": np.hstack([good, np.zeros((2, 1))]),
        "too few rows": good[:1],
        "negative": np.array([[1.5, -0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]),
        "infinite": np.array([[np.inf, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]),
        "nan": np.array([[np.nan, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]]),
        "not normalised": good * 1.002,
    }
    for why, probs in bad.items():
        d = sanitize_draft(Draft((1, 2), probs), 8, 4)
        assert d.tokens == (1, 2) and d.probs is None, why


def test_sanitize_keeps_the_valid_prefix_of_a_tree():
    """Tree drafts (parents): a node is kept while its parent is -1 (the root) or an earlier
    node, and its token is valid; the first bad node ends the draft."""
    t = Draft((1, 2, 3, 4), parents=(-1, 0, 0, 1))
    assert sanitize_draft(t, 8, 64) is t

    def kept(tokens, parents, k=8):
        d = sanitize_draft(Draft(tuple(tokens), parents=tuple(parents)), k, 64)
        return d.tokens, d.parents

    assert kept((1, 2, 3, 4), (-1, 0, 2, 1)) == ((1, 2), (-1, 0))  # a parent not before it
    assert kept((1, 2, 3), (-1, -2, 0)) == ((1,), (-1,))
    assert kept((1, 2, 3), (-1, 0, 1.0)) == ((1, 2), (-1, 0))
    assert kept((1, 2, 3), (-1, -1, 1)) == ((1, 2, 3), (-1, -1, 1))  # two children of the root
    assert kept((1, 2, 3), (0, 0, 1)) == ((), ())  # the first node's parent must be the root
    assert kept((1, 2), (-1, 0, 1)) == ((1, 2), (-1, 0))  # parents past the tokens
    assert kept((1, 99, 3), (-1, 0, 1)) == ((1,), (-1,))  # a bad token ends the tree too
    assert kept((1, 2, 3), (-1, 0, 1), k=2) == ((1, 2), (-1, 0))
    d = sanitize_draft(Draft((1, 2, 3), parents=(np.int64(-1), np.int64(0), np.int64(0))), 8,
                       64)
    assert d.tokens == (1, 2, 3) and d.parents == (-1, 0, 0)
    probs = np.full((3, 4), 0.25)
    d = sanitize_draft(Draft((1, 2, 3), probs, parents=(-1, 0, 5)), 8, 4)
    assert d.parents == (-1, 0) and d.probs.shape == (2, 4)
    assert sanitize_draft(Draft((1, 2)), 8, 64).parents is None
