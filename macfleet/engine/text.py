"""Text in, text out around a decode: prompt encoding, streaming detokenization (`TextStream`,
`with_text`), and how a drafter spec splits into chains or a tree (`plan_drafting`), which the
serving engine (serve/drafting.py) and the verifier agent (agents/verifier_drafting.py) both
follow."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from macfleet.engine.conversation import ChatInput, check_conversation, messages, render
from macfleet.engine.events import Event, Finished, TokensCommitted
from macfleet.engine.proposers import Proposer, drafts_tree
from macfleet.engine.proposers.group import ProposerGroup

MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_TOKENS = 256  # answer tokens when a caller names no limit


class PromptError(ValueError):
    """A prompt that cannot be run (empty, or longer than the limit)."""


def encode_prompt(tokenizer, prompt: ChatInput, chat: bool) -> list[int]:
    """Token ids of a text (chat template applied when `chat`) or of a conversation (always
    through the chat template when the tokenizer has one; its contents joined otherwise)."""
    if not prompt:
        raise PromptError("empty prompt")
    if not isinstance(prompt, str):
        try:
            check_conversation(prompt)
        except ValueError as e:
            raise PromptError(str(e)) from None
        chat = True
    if chat and getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template(messages(prompt), add_generation_prompt=True)
    else:
        ids = tokenizer.encode(prompt if isinstance(prompt, str) else render(tokenizer, prompt))
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


def no_drafts(spec: str):
    """Refuse a drafter that drafts nothing (`none`) as a branch of a tree."""
    raise ValueError(f"'{spec}' drafts nothing: it cannot be part of a proposer tree")


@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: tuple[int, ...]  # () for the detokenizer's final flush


Drafting = Proposer | ProposerGroup | None  # a chain drafter, a tree of drafters, or none


def plan_drafting(spec: str, *, chain: Callable[[str], Proposer | None],
                  tree: Callable[[list[str]], ProposerGroup]) -> Drafting:
    """Split `spec` on '+': several drafters, or one that drafts trees, draft a token tree
    each block (`tree(specs)`); one chain drafter chains (`chain(spec)`, None for `none`)."""
    return tree(spec.split("+")) if drafts_tree(spec) else chain(spec)


def with_text(events: Iterable[Event], stream: TextStream) -> Iterator[TextDelta | Event]:
    """A decode's events with a TextDelta per TokensCommitted, and the detokenizer's flush
    before Finished."""
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
