"""Bad model/proposer specs and bad arguments fail up front with errors that name the problem."""

from __future__ import annotations

import pytest

from macfleet.engine.controller import make_controller
from reference_loops import speculative_generate
from macfleet.engine.models import ModelSpecError, load_model
from macfleet.engine.proposers import ProposerSpecError, make_proposer, parse_proposer_spec
from macfleet.engine.sampling import SamplingParams
from macfleet.engine.text import PromptError, encode_prompt
from macfleet.engine.verifier import Verifier


@pytest.mark.parametrize("spec,words", [
    ("tiny:x", ["tiny:x", "tiny:<seed>"]),
    ("tiny:", ["tiny:"]),
    ("tiny:1:1", ["vocab"]),
    ("tiny:1:64:9", ["tiny:1:64:9"]),
    ("nope.gguf", ["nope.gguf"]),
    ("", ["empty"]),
    ("smollm2:huge", ["smollm2:huge"]),
])
def test_bad_model_spec(spec, words):
    with pytest.raises(ModelSpecError) as e:
        load_model(spec)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_empty_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelSpecError, match="config.json") as e:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file")
    with pytest.raises(ModelSpecError) as e:
        load_model(str(bad), cached=False)
    assert "broken.gguf" in str(e.value)


def test_tiny_spec_builds_and_caches():
    a = load_model("tiny:7:16")
    assert a.vocab_size == 16 and a.num_layers == 4
    assert load_model("tiny:7:16") is a
    assert load_model("tiny:7:16", cached=False) is not a


@pytest.mark.parametrize("spec,words", [
    ("layerskip:0", ["layerskip:0", "1..3"]),
    ("layerskip:4", ["layerskip:4", "1..3", "4 layers"]),
    ("layerskip:999", ["layerskip:999", "1..3"]),
    ("layerskip", ["layerskip"]),
    ("layerskip:x", ["whole number"]),
    ("foo:1", ["foo:1", "unknown proposer"]),
    ("ngram:0", ["ngram", "1..8"]),
    ("ngram:9", ["1..8"]),
    ("none:3", ["none"]),
    ("draft", ["draft"]),
    ("draft:tiny:1:32", ["vocabulary 32", "64", "tokenizer"]),
    ("draft:nope.gguf", ["draft model", "nope.gguf"]),
])
def test_bad_proposer_spec(tiny, spec, words):
    with pytest.raises(ProposerSpecError) as e:
        make_proposer(spec, tiny)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("spec,kind", [
    ("none", type(None)), ("ngram", "NgramProposer"), ("ngram:2", "NgramProposer"),
    ("layerskip:2", "ModelProposer"), ("draft:tiny:2:64", "ModelProposer"),
])
def test_good_proposer_specs(tiny, spec, kind):
    p = make_proposer(spec, tiny)
    assert (p is None) if kind is type(None) else type(p).__name__ == kind
    assert str(parse_proposer_spec(spec)) == spec


@pytest.mark.parametrize("kwargs,word", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
])
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("k", [-1, 65, "x", "1.5"])
def test_bad_draft_length(k):
    with pytest.raises(ValueError):
        make_controller(k)


def test_good_draft_lengths():
    assert make_controller(0).next_k() == 0
    assert make_controller(64).next_k() == 64
    assert make_controller("3").next_k() == 3
    assert type(make_controller("auto")).__name__ == "AdaptiveDraftLength"


def test_empty_prompt(tiny):
    with pytest.raises(ValueError, match="empty prompt"):
        next(speculative_generate(Verifier(tiny.model), None, []))
    with pytest.raises(PromptError, match="empty"):
        encode_prompt(tiny.tokenizer, "", chat=True)


@pytest.mark.parametrize("bad", [64, 10_000, -1])
def test_out_of_vocab_prompt_ids(tiny, bad):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        next(speculative_generate(Verifier(tiny.model), None, [1, 2, bad]))


def test_negative_max_tokens(tiny):
    with pytest.raises(ValueError, match="max_tokens"):
        next(speculative_generate(Verifier(tiny.model), None, [1, 2], max_tokens=-1))
