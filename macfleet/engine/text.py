"""Text in, text out around the token loops: prompt encoding, streaming detokenization, and the
one generation driver (`plan_drafting` + `generate_from_ids`) that `generate_local` and the
verifier agent both run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from macfleet.engine.constraint import Constraint, Grammar
from macfleet.engine.controller import AUTO, DraftTokens, make_controller
from macfleet.engine.conversation import ChatInput, check_conversation, messages, render
from macfleet.engine.events import Event, Finished, TokensCommitted
from macfleet.engine.loop import speculative_generate
from macfleet.engine.models import LoadedModel
from macfleet.engine.proposers import Proposer, drafts_tree, make_proposer
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.engine.proposers.group import ProposerGroup, make_group
from macfleet.engine.tree_loop import tree_generate
from macfleet.engine.verifier import Verifier

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
    """Split `spec` on '+': several drafters, or one that drafts trees itself, draft a token
    tree each block (`tree(specs)`); one chain drafter drafts chains (`chain(spec)`, None for
    `none`). The caller builds (local proposers here, remote ones in the verifier agent)."""
    return tree(spec.split("+")) if drafts_tree(spec) else chain(spec)


def generate_from_ids(lm: LoadedModel, verifier, drafting: Drafting, ids: Sequence[int], *,
                      draft_tokens: DraftTokens = AUTO, max_tokens: int = DEFAULT_MAX_TOKENS,
                      params: SamplingParams = GREEDY, grammar: Grammar | None = None
                      ) -> Iterator[TextDelta | Event]:
    """The one generation driver (in-process and in the verifier agent): the tree loop for a
    group of drafters, the chain loop otherwise; TextDelta for each commit, BlockDone per block,
    the detokenizer's flush as a last TextDelta, then Finished. grammar: the answer must match
    it (issue 32: chains and trees cut to it, forced tokens drafted first, rows masked)."""
    constraint = Constraint(grammar, lm.tokenizer, lm.vocab_size) if grammar else None
    if isinstance(drafting, ProposerGroup):
        events = tree_generate(verifier, drafting, ids, params=params, max_tokens=max_tokens,
                               eos_ids=lm.eos_ids, constraint=constraint)
    else:
        controller = make_controller(draft_tokens if drafting is not None else 0)
        events = speculative_generate(verifier, drafting, ids, params=params,
                                      max_tokens=max_tokens, controller=controller,
                                      eos_ids=lm.eos_ids, constraint=constraint)
    yield from with_text(events, TextStream(lm.tokenizer))


def with_text(events: Iterable[Event], stream: TextStream) -> Iterator[TextDelta | Event]:
    """A decode's events with each commit as text: TextDelta for each TokensCommitted, the
    detokenizer's flush as a last TextDelta before Finished; other events as they are."""
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


def generate_local(
    lm: LoadedModel,
    prompt: ChatInput,
    *,
    chat: bool = True,
    proposer: str = "ngram",
    draft_tokens: DraftTokens = AUTO,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    params: SamplingParams = GREEDY,
    verifier: Verifier | None = None,
    grammar: Grammar | None = None,
) -> Iterator[TextDelta | Event]:
    """In-process speculative generation: TextDelta for each commit, BlockDone, then Finished.
    prompt: a text, or a conversation (conversation.Turn, ...) ending on a user turn."""
    ids = encode_prompt(lm.tokenizer, prompt, chat)

    def make(spec: str) -> Proposer | None:
        return make_proposer(spec, lm)

    if proposer == AUTO:  # chosen block by block (engine/choosing.py)
        from macfleet.engine.choosing import auto_spec, make_auto_group

        proposer = auto_spec(lm)
    if proposer == AUTO:
        drafting: Drafting = make_auto_group(lm, draft_tokens)
    else:
        drafting = plan_drafting(proposer, chain=make, tree=lambda specs: make_group(
            [make(s) or no_drafts(s) for s in specs], draft_tokens))
    yield from generate_from_ids(lm, verifier or Verifier(lm.model), drafting, ids,
                                 draft_tokens=draft_tokens, max_tokens=max_tokens, params=params,
                                 grammar=grammar)
