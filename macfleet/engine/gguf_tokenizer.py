"""Build a Hugging Face fast tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

Byte-level BPE ("gpt2") only, what llama-family GGUFs of HF models carry; SmolLM2's digit
splitting is reproduced, control tokens stay single special ids, and the result is wrapped in
mlx-lm's `TokenizerWrapper` so its chat template and streaming detokenizer work unchanged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from macfleet.engine.gguf import GGUFError

_CONTROL = 3
_DIGIT_SPLITTING_PRE = {"smollm", "llama-bpe", "llama3", "qwen2", "deepseek-llm"}


def _ids(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    return int(v.item()) if isinstance(v, mx.array) else int(v)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> TokenizerWrapper:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"only byte-level BPE GGUF tokenizers are supported (got '{kind}')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else list(types or [])
    vocab = {t: i for i, t in enumerate(tokens)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre", "smollm") in _DIGIT_SPLITTING_PRE:
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])

    def name(key: str) -> str | None:
        i = _ids(meta, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=name("tokenizer.ggml.bos_token_id"),
        eos_token=name("tokenizer.ggml.eos_token_id"),
        unk_token=name("tokenizer.ggml.unknown_token_id"),
        pad_token=name("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer)
