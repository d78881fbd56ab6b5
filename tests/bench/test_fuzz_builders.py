"""The fuzz campaign's hostile builders: each category is refused by the codec with a typed code
(so the campaign's figures count real refusals, not builder bugs)."""

from __future__ import annotations

import random

import pytest

from bridge.codec import Limits
from bridge.errors import CODES, ProtocolError
from macfleet.bench.fuzz import CATEGORIES

REFUSED = [c for c in CATEGORIES if c != "valid_any_type"]


@pytest.mark.parametrize("category", REFUSED)
def test_each_hostile_category_is_a_typed_refusal(category):
    rng = random.Random(1)
    for _ in range(50):
        frames = CATEGORIES[category](rng)
        try:
            Limits().decode(frames)
        except ProtocolError as e:
            assert e.code in CODES
            continue
        assert category in ("random_frames", "wrong_types"), frames  # only chance makes these valid


def test_valid_messages_decode():
    rng = random.Random(2)
    for _ in range(20):
        Limits().decode(CATEGORIES["valid_any_type"](rng))
