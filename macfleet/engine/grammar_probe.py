"""Whether a grammar runs within llguidance's limits, decided before a request is admitted.

Some grammars compile and then fail a few tokens in, when a parser row outgrows the engine's
limits (`start: "t0" | ... | "t1999"`: `ParserTooComplex`), and would end a request at once
with an empty answer. So a grammar is also run: one path of up to `PROBE_STEPS` tokens (the
forced ones, else the lowest allowed non-eos), every step's mask computed. Why one path and a
byte tokenizer suffice: docs/engine.md, "Grammar probe".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

PROBE_STEPS = 64  # tokens walked at most
_BYTE_EOS = 256


class TokenList:
    """A tokenizer llguidance reads as a list of token bytes with one end-of-sequence id (its
    `TokenizerWrapper` protocol); encode: text bytes -> token ids."""

    def __init__(self, tokens: list[bytes], eos: int,
                 encode: Callable[[bytes], list[int]]) -> None:
        self.tokens, self._encode = tokens, encode
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = [eos]

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text)


@functools.lru_cache(maxsize=1)
def byte_tokenizer():
    """256 one-byte tokens and an end-of-sequence."""
    import llguidance

    wrap = TokenList([bytes([i]) for i in range(256)] + [b"<|eos|>"], _BYTE_EOS, list)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrap), n_vocab=257)


def _failed(tokens: int, err: str) -> str:
    first = (err.strip().splitlines() or ["grammar engine error"])[0][:300]
    return f"the grammar engine fails {tokens} token{'' if tokens == 1 else 's'} in: {first}"


def run_error(text: str, tokenizer=None, steps: int = PROBE_STEPS) -> str | None:
    """The engine's error when a compiled grammar (llguidance's form) is run for up to `steps`
    tokens on one path (None: it ran, or ended, within its limits)."""
    from llguidance import LLMatcher

    ll = tokenizer if tokenizer is not None else byte_tokenizer()
    m = LLMatcher(ll, text, log_level=0)
    eos = set(int(t) for t in ll.eos_tokens)
    vocab = ll.vocab_size
    for step in range(steps):
        if m.is_error():
            return _failed(step, m.get_error())
        if m.is_stopped():
            return None
        forced = [int(t) for t in m.compute_ff_tokens()]
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:vocab]
        if m.is_error():
            return _failed(step, m.get_error())
        # the lowest allowed ids, enough of them to hold one that is not end-of-sequence
        allowed = [int(t) for t in np.flatnonzero(bits)[:len(eos) + 1] if int(t) not in eos]
        nxt = forced[:1] or allowed[:1]
        if not nxt:
            return None  # only end-of-sequence (or nothing) is allowed: the walk is over
        if not m.consume_token(nxt[0]):
            return _failed(step + 1, m.get_error())
    return None
