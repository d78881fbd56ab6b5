"""The embedded SmolLM2 loads correctly: perplexity, a factual answer, its tokenizer, and the
Q/K row permutation the GGUF loader undoes.

A wrong rope layout still writes fluent fragments, so correctness is checked by perplexity
(correct loading: about 6 on this paragraph; a wrong Q/K layout: about 60).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macfleet.engine.events import Finished
from macfleet.engine.gguf import unpermute_rows
from macfleet.engine.text import TextDelta
from reference_loops import generate_local

PARAGRAPH = (
    "Paris is the capital and most populous city of France. With an estimated population of "
    "2,102,650 residents in January 2023 in an area of more than 105 square kilometres, Paris "
    "is the fourth-most populated city in the European Union and the 30th most densely "
    "populated city in the world in 2022. Since the 17th century, Paris has been one of the "
    "world's major centres of finance, diplomacy, commerce, culture, fashion, and gastronomy."
)


def perplexity(model, ids: list[int]) -> float:
    logits = model(mx.array(ids, dtype=mx.uint32)[None])[0].astype(mx.float32)  # [L, V]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp[:-1], mx.array(ids[1:])[:, None], axis=-1).mean()
    return float(np.exp(nll.item()))


@pytest.mark.slow
def test_embedded_model_loads_with_expected_shape(smollm2):
    assert smollm2.num_layers == 30
    assert smollm2.vocab_size == 49152
    assert smollm2.hidden_size == 576
    assert smollm2.eos_ids  # the chat template's <|im_end|>
    assert smollm2.tokenizer.has_chat_template


@pytest.mark.slow
def test_perplexity_of_encyclopedia_paragraph(smollm2):
    ids = smollm2.tokenizer.encode(PARAGRAPH)
    assert len(ids) > 80
    ppl = perplexity(smollm2.model, ids)
    assert ppl < 10.0, f"perplexity {ppl:.1f}: the weights are loaded wrongly (rope layout?)"
    assert ppl > 1.5, f"perplexity {ppl:.2f} is implausibly low"


@pytest.mark.slow
def test_chat_answer_mentions_paris(smollm2):
    parts: list[str] = []
    fin = None
    for ev in generate_local(smollm2, "What is the capital of France?", max_tokens=20):
        if isinstance(ev, TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, Finished):
            fin = ev
    text = "".join(parts)
    assert "Paris" in text, text
    assert fin is not None and text == smollm2.tokenizer.decode(list(fin.token_ids))


@pytest.mark.slow
@pytest.mark.parametrize("text", [
    "Digits 1234567890 and 3.14159, year 2024!",
    "Unicode: café, naïve, Ελληνικά, 日本語, emoji 🙂👍🏽, tab\tand\nnewline",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces and trailing   ",
])
def test_tokenizer_round_trip(smollm2, text):
    tok = smollm2.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


@pytest.mark.slow
def test_tokenizer_specials_and_digits(smollm2):
    tok = smollm2.tokenizer
    start = tok.encode("<|im_start|>", add_special_tokens=False)
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(start) == 1 and len(end) == 1, (start, end)
    assert end[0] in smollm2.eos_ids
    # the chat template's markers stay single ids inside a longer text
    ids = tok.encode("hi<|im_start|>there", add_special_tokens=False)
    assert start[0] in ids
    # the Digits(individual) pre-tokenizer: one id per digit
    digits = tok.encode("1234567890", add_special_tokens=False)
    assert len(digits) == 10
    assert [tok.decode([i]) for i in digits] == list("1234567890")
    # the chat template produces the special ids, not their spelled-out pieces
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True)
    assert chat.count(start[0]) >= 2 and end[0] in chat
    # golden ids: " " then one id per digit ("0" is id 32), a comma, a word
    assert tok.encode("In 2023, 105 km", add_special_tokens=False) == [
        788, 216, 34, 32, 34, 35, 28, 216, 33, 32, 37, 6381]


@pytest.mark.slow
def test_every_control_token_is_one_special_id(smollm2):
    """The 17 control tokens of the GGUF (ids 0..16) are special: each encodes to its own id,
    also inside text, and `skip_special_tokens` drops them."""
    tok = smollm2.tokenizer
    names = [tok.decode([i]) for i in range(17)]
    assert names[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for i, name in enumerate(names):
        assert name.startswith("<") and name.endswith(">"), name
        assert tok.encode(f"a{name}b", add_special_tokens=False)[1:-1] == [i], name
    assert tok.decode([19556, 1, 2, 0], skip_special_tokens=True) == "Hello"


def llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp's convert script `permute()` of Q/K rows (written out independently here)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,cols", [(4, 8, 6), (9, 64, 3), (3, 2, 5)])
def test_unpermute_rows_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rows = n_head * head_dim
    w = mx.arange(rows * cols, dtype=mx.float32).reshape(rows, cols)
    permuted = llama_cpp_permute(w, n_head)
    if head_dim > 2:
        assert not mx.array_equal(permuted, w)  # the permutation is not the identity
    assert mx.array_equal(unpermute_rows(permuted, n_head), w)
    assert mx.array_equal(llama_cpp_permute(unpermute_rows(w, n_head), n_head), w)


def test_unpermute_rows_pairs_rotary_halves():
    """Within each head, row j of the first half pairs with row j of the second half."""
    n_head, head_dim = 2, 8
    w = mx.arange(n_head * head_dim, dtype=mx.float32)[:, None]
    gguf = llama_cpp_permute(w, n_head)  # interleaved: 0, 4, 1, 5, 2, 6, 3, 7 per head
    assert gguf[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpermute_rows(gguf, n_head)[:, 0].tolist() == list(range(16))


@pytest.mark.slow
def test_bfloat16_embedded_model_is_bf16_and_still_correct(smollm2):
    """`smollm2:bf16` (what a GPU may run fastest) casts every weight; perplexity stays within
    a few percent of float32's (bfloat16 keeps 8 bits of mantissa). On the paragraph's first
    24 tokens: MLX's CPU runs bfloat16 matmuls slowly (the whole paragraph's 111 tokens took
    23 s, 24 take 3.5; bfloat16's perplexity is within 0.2 % and 0.7 % of float32's there),
    and weights off by ~4 % move it by 17 % (docs/testing.md, ninth round)."""
    from macfleet.engine.models import ModelSpecError, load_model

    lm = load_model("smollm2:bf16")
    assert lm.model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    ids = lm.tokenizer.encode(PARAGRAPH)[:24]
    ppl32, ppl16 = perplexity(smollm2.model, ids), perplexity(lm.model, ids)
    assert abs(ppl16 - ppl32) / ppl32 < 0.1, (ppl16, ppl32)
    with pytest.raises(ModelSpecError, match="smollm2:bf16"):
        load_model("smollm2:fp8")
