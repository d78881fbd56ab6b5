"""The one spec check (`agents.specs`) and the bounded draft-model cache."""

from __future__ import annotations

import os

import pytest

from agents.specs import DraftModels, SpecPolicy, check_spec, local_spec
from bridge.errors import ProtocolError
from macfleet.engine import models

pytestmark = pytest.mark.timeout(60)


def refused(spec, policy):
    with pytest.raises(ProtocolError) as e:
        check_spec(spec, policy)
    assert e.value.code == "bad_request"
    return str(e.value)


@pytest.fixture
def heads(tmp_path):
    d = tmp_path / "heads"
    d.mkdir()
    (d / "head.safetensors").write_bytes(b"x")
    (d / "mydraft").mkdir()
    (tmp_path / "secret.json").write_text("{}")
    os.symlink(tmp_path / "secret.json", d / "escape.json")
    return d


@pytest.mark.parametrize("spec", [
    "eagle:../secret", "eagle:/etc/passwd", "eagle2:~/x", "retrieval:a/../../secret",
    "eagle:escape.json", "draft:/etc", "draft:./rel", "draft:../heads/mydraft", "draft:~/m",
    "draft:org/name", "draft:x.gguf", "ngram+draft:/etc", "bogus", "eagle:" + "a" * 600,
])
def test_refused_without_touching_the_disk_outside_heads(spec, heads):
    refused(spec, SpecPolicy(heads_dir=str(heads)))


@pytest.mark.parametrize("spec", [
    "none", "ngram", "ngram:3", "layerskip:2", "eagle", "eagle2", "retrieval",
    "eagle:head.safetensors", "draft:tiny:3", "draft:tiny:3:64", "draft:smollm2",
    "draft:smollm2:q", "draft:mydraft", "ngram+draft:tiny:3", "draft:tiny:1",
])
def test_allowed(spec, heads):
    check_spec(spec, SpecPolicy(heads_dir=str(heads), own_model="tiny:1"))


def test_names_need_a_heads_dir_and_hub_ids_need_the_flag():
    assert "--heads" in refused("eagle:head", SpecPolicy())
    assert "--allow-hub" in refused("draft:org/name", SpecPolicy())
    check_spec("draft:org/name", SpecPolicy(allow_hub=True))
    refused("draft:../org/name", SpecPolicy(allow_hub=True))
    assert "serves" in refused("draft:tiny:3", SpecPolicy(kinds=("ngram",)))


def test_local_spec_resolves_names_inside_heads(heads):
    p = SpecPolicy(heads_dir=str(heads))
    assert local_spec("eagle:head.safetensors", p) == f"eagle:{heads.resolve()}/head.safetensors"
    assert local_spec("draft:mydraft", p) == f"draft:{heads.resolve()}/mydraft"
    assert local_spec("draft:tiny:3+ngram", p) == "draft:tiny:3+ngram"


def test_draft_models_are_an_lru_and_never_enter_the_process_cache():
    own = models.load_model("tiny:1")
    cache = DraftModels()  # at most DEFAULT_MAX_DRAFT_MODELS (2)
    for seed in (31, 32, 33, 31):
        p = cache.proposer(f"draft:tiny:{seed}", own)
        assert p.name == f"draft:tiny:{seed}"
    assert len(cache) == 2 and list(cache._lru) == ["tiny:33", "tiny:31"]
    assert not any(k[0] in ("tiny:31", "tiny:32", "tiny:33") for k in models._cache)
    assert cache.get("tiny:1", own) is own and len(cache) == 2
