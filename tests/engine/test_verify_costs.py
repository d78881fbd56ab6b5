"""verify(L) measured on the verifier: the table trees are sized against."""

from __future__ import annotations

import json

from macfleet.engine import verify_costs as vc


def test_probe_times_every_length_and_leaves_no_trace(tiny, tmp_path, monkeypatch):
    """Every length is timed after the same `context` cached tokens (the probe rolls each
    forward back; without it L=4 would be timed after 8 + 3 * 1 + 3 * 2 tokens), and the probe
    itself writes nothing: no cost table on disk, none memoised (that is verify_costs' job)."""
    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path))
    monkeypatch.setattr(vc, "_memo", {})
    seen: list[tuple[int, int]] = []  # (offset before the forward, tokens)
    made: list[vc.Verifier] = []

    class Spy(vc.Verifier):
        def __init__(self, model):
            super().__init__(model)
            made.append(self)

        def forward(self, tokens, *a, **kw):
            seen.append((self.offset, len(tokens)))
            return super().forward(tokens, *a, **kw)

    monkeypatch.setattr(vc, "Verifier", Spy)
    costs = vc.probe_verify_costs(tiny.model, lengths=(1, 2, 4), context=8, reps=1)
    assert sorted(costs) == [1, 2, 4] and all(ms > 0 for ms in costs.values())
    # a warm-up and `reps` runs per length, each after exactly the context
    assert seen == [(8, 1), (8, 1), (8, 2), (8, 2), (8, 4), (8, 4)], seen
    assert len(made) == 1 and made[0].offset == 8  # its own verifier, rolled back at the end
    assert list(tmp_path.rglob("*")) == [] and vc._memo == {}


def test_the_table_is_measured_once_per_machine_and_model(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path))
    monkeypatch.setattr(vc, "_memo", {})
    monkeypatch.setattr(vc, "machine_busy", lambda: False)
    calls = []
    real = vc.probe_verify_costs
    monkeypatch.setattr(vc, "probe_verify_costs",
                        lambda m: calls.append(1) or real(m, lengths=(1, 3), context=4, reps=1))
    first = vc.verify_costs(tiny.model)
    assert vc.verify_costs(tiny.model) is first and len(calls) == 1  # memoised in-process
    files = list((tmp_path / "verify-costs").glob("*.json"))
    assert len(files) == 1 and {int(k) for k in json.loads(files[0].read_text())} == {1, 3}
    monkeypatch.setattr(vc, "_memo", {})
    assert vc.verify_costs(tiny.model) == first and len(calls) == 1  # read back from disk
    files[0].write_text("{not json")
    monkeypatch.setattr(vc, "_memo", {})
    assert set(vc.verify_costs(tiny.model)) == {1, 3}
    assert len(calls) == 2  # a damaged cache file is measured again, not trusted


def test_a_probe_on_a_loaded_machine_is_not_kept_on_disk(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path))
    monkeypatch.setattr(vc, "_memo", {})
    monkeypatch.setattr(vc, "machine_busy", lambda: True)
    monkeypatch.setattr(vc, "probe_verify_costs", lambda m: {1: 5.0, 2: 6.0})
    assert vc.verify_costs(tiny.model) == {1: 5.0, 2: 6.0}
    assert not list(tmp_path.rglob("*.json"))


def test_a_process_pinned_to_fewer_cores_has_a_table_of_its_own(tiny, monkeypatch):
    # a verifier agent pinned to one core computes at one core's pace: the sawtooth probed
    # with two cores would size its chunks and drafts wrong
    monkeypatch.setattr(vc, "usable_cores", lambda: 2)
    two = vc._key(tiny.model)
    monkeypatch.setattr(vc, "usable_cores", lambda: 1)
    assert vc._key(tiny.model) != two
    monkeypatch.setattr(vc, "usable_cores", lambda: 2)
    assert vc._key(tiny.model) == two



def test_a_freed_models_table_is_not_another_models(tiny, monkeypatch):
    """The memo is keyed by id(model), and Python reuses the id of a freed object: a new model
    at that address must not be handed the old one's table (the suite once sized a smollm2
    tree by a tiny model's table this way)."""
    import gc

    from macfleet.engine.tiny import build_tiny_model

    monkeypatch.setattr(vc, "_memo", {})
    old = build_tiny_model(3)
    vc._remember(old, {1: 1.0, 2: 1.5})
    assert vc._remembered(old) == {1: 1.0, 2: 1.5}
    stale = id(old)
    del old
    gc.collect()
    assert vc._memo[stale][0]() is None
    # whatever now lives at that id (or any other model) is not the freed one
    assert vc._remembered(tiny.model) is None
    new = build_tiny_model(4)
    vc._memo[id(new)] = vc._memo.pop(stale)  # the same id, as a reused address gives it
    assert vc._remembered(new) is None
