"""Planning inputs (topology/inputs.py): a live fleet's statuses and a model's shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from macfleet.topology.fleet_spec import SMOLLM2, Profile
from macfleet.topology.inputs import (ModelShapeError, fleet_from_statuses, measured_profile,
                                      model_shape)


def _status(name: str, rtt: float | None):
    card = SimpleNamespace(name=name, chip="M2", mem_free=8 << 30, roles=("verifier",))
    return SimpleNamespace(card=card, rtt_p50_ms=rtt)


def test_a_live_fleet_links_every_pair_at_the_larger_rtt():
    fleet = fleet_from_statuses([_status("a", 1.0), _status("b", 3.0), _status("c", None)],
                                Profile(), SMOLLM2)
    assert [h.name for h in fleet.hosts] == ["a", "b", "c"]
    assert {(ln.a, ln.b): ln.rtt_ms for ln in fleet.links} == {
        ("a", "b"): 3.0, ("a", "c"): 1.0, ("b", "c"): 3.0}


def test_model_shape_and_profile_defaults(tmp_path):
    assert model_shape(None) == SMOLLM2 == model_shape("smollm2:q")
    with pytest.raises(ModelShapeError, match="mlx-lm model directory"):
        model_shape(str(tmp_path / "nope"))
    assert measured_profile(tmp_path) == Profile()  # nothing measured: the stated defaults
