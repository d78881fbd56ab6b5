"""A request as a conversation: earlier turns (the user's, the assistant's) before the user's
last one, rendered through the tokenizer's chat template like a single message is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Turn:
    role: str  # system | user | assistant
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"a turn's role is one of {', '.join(ROLES)}, not {self.role!r}")


Conversation = tuple[Turn, ...]
ChatInput = str | Conversation  # one user message, or a conversation ending on a user turn


def messages(prompt: ChatInput) -> list[dict[str, str]]:
    """The chat template's input: [{"role", "content"}, ...]."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": t.role, "content": t.content} for t in prompt]


def check_conversation(turns: Sequence[Turn]) -> None:
    """A conversation must end on a user turn (the model answers it). ValueError otherwise."""
    if not turns or turns[-1].role != "user":
        raise ValueError("a conversation ends on a user turn")


def render(tokenizer, prompt: ChatInput) -> str:
    """The text the model reads for `prompt`: its chat template applied (generation prompt
    added) when the tokenizer has one, else the turns' contents joined by newlines; encoded,
    it gives `text.encode_prompt`'s ids."""
    if not isinstance(prompt, str):
        check_conversation(prompt)
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template(messages(prompt), add_generation_prompt=True,
                                             tokenize=False)
    return prompt if isinstance(prompt, str) else "\n".join(t.content for t in prompt)
