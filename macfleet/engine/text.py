"""Text in, text out around the token loop: prompt encoding and streaming detokenization."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from macfleet.engine.controller import make_controller
from macfleet.engine.events import Event, Finished, TokensCommitted
from macfleet.engine.loop import DEFAULT_MAX_TOKENS, speculative_generate
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import make_proposer
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.tree_loop import ProposerGroup, tree_budget, tree_generate
from macfleet.engine.verifier import Verifier

MAX_PROMPT_TOKENS = 32768


class PromptError(ValueError):
    """A prompt that cannot be run (empty, or longer than the limit)."""


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise PromptError("empty prompt")
    if chat and getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True)
    else:
        ids = tokenizer.encode(prompt)
    ids = list(ids)
    if len(ids) > MAX_PROMPT_TOKENS:
        raise PromptError(f"prompt is {len(ids)} tokens; the limit is {MAX_PROMPT_TOKENS}")
    return ids


class TextStream:
    """Incremental detokenization (mlx-lm's streaming detokenizer when the tokenizer has one)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._detok = getattr(tokenizer, "detokenizer", None)
        if self._detok is not None:
            self._detok.reset()

    def add(self, tokens: Sequence[int]) -> str:
        if self._detok is None:
            return self._tok.decode(list(tokens))
        for t in tokens:
            self._detok.add_token(int(t))
        return self._detok.last_segment

    def finish(self) -> str:
        if self._detok is None:
            return ""
        self._detok.finalize()
        return self._detok.last_segment


def _none(spec: str):
    raise ValueError(f"'{spec}' drafts nothing: it cannot be part of a proposer tree")


@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: tuple[int, ...]


def generate_local(
    lm: LoadedModel,
    prompt: str,
    *,
    chat: bool = True,
    proposer: str = "ngram",
    draft_tokens: int | str = "auto",
    max_tokens: int = DEFAULT_MAX_TOKENS,
    params: SamplingParams = GREEDY,
    verifier: Verifier | None = None,
) -> Iterator[TextDelta | Event]:
    """In-process speculative generation: TextDelta for each commit, BlockDone, then Finished."""
    ids = encode_prompt(lm.tokenizer, prompt, chat)
    stream = TextStream(lm.tokenizer)
    verifier = verifier or Verifier(lm.model)
    single = None if "+" in proposer else make_proposer(proposer, lm)
    if "+" in proposer or (single is not None and single.drafts_trees):
        # several proposers, or one that drafts trees: a token tree per block
        props = [single] if single is not None else [
            make_proposer(s, lm) or _none(s) for s in proposer.split("+")]
        group = ProposerGroup(props, draft_tokens=draft_tokens,
                              node_budget=tree_budget(props))
        events = tree_generate(verifier, group, ids, params=params, max_tokens=max_tokens,
                               eos_ids=lm.eos_ids)
    else:
        prop = single
        controller = make_controller(draft_tokens if prop is not None else 0)
        events = speculative_generate(verifier, prop, ids, params=params, max_tokens=max_tokens,
                                      controller=controller, eos_ids=lm.eos_ids)
    for ev in events:
        if isinstance(ev, TokensCommitted):
            yield TextDelta(stream.add(ev.tokens), ev.tokens)
        elif isinstance(ev, Finished):
            tail = stream.finish()
            if tail:
                yield TextDelta(tail, ())
            yield ev
        else:
            yield ev
