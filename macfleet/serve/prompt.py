"""A request's prompt: messages (and tools) through the model's chat template, to token ids.
The template renders the tools itself and tells which tool-call format to parse;
`serve --chat-template FILE` replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from macfleet.serve.schemas import GenerationRequest, Limits, RequestError
from macfleet.serve.tools import NONE, detect_format


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str
    tool_format: str | None = None  # parse the answer's tool calls in this format (None: don't)


def template_text(tokenizer, override: str | None) -> str | None:
    """The chat template in force: the override, else the tokenizer's own (None: none)."""
    if override is not None:
        return override
    t = getattr(tokenizer, "chat_template", None)
    return t if isinstance(t, str) else None


def render_prompt(tok, req: GenerationRequest, limits: Limits,
                  chat_template: str | None = None) -> Prompt:
    """Token ids and text of the prompt; 400 for tools on a template without tool support, a
    template that refuses the conversation, or a prompt over the limit."""
    fmt = None
    if req.chat:
        if req.tools and req.tool_choice.mode != NONE:
            fmt = detect_format(template_text(tok, chat_template))
            if fmt is None:
                raise RequestError(
                    "this model's chat template has no tool support (none of the tool-call "
                    "formats macfleet parses: Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral "
                    "[TOOL_CALLS]); give it one with --chat-template FILE (on `macfleet serve`, "
                    "or `macfleet up --serve` for a fleet)",
                    param="tools", code="tools_unsupported")
        text, ids = _chat(tok, req, chat_template, fmt)
    else:
        text = req.prompt
        ids = tok.encode(text)
    ids = tuple(int(t) for t in ids)
    lim = limits.max_prompt_tokens
    if not ids:
        raise RequestError("the prompt encodes to no tokens", param="prompt")
    if len(ids) > lim:
        raise RequestError(f"the prompt is {len(ids)} tokens; this server's limit is {lim}",
                           param="messages" if req.chat else "prompt",
                           code="context_length_exceeded")
    return Prompt(ids, text, fmt)


def _chat(tok, req: GenerationRequest, override: str | None, fmt: str | None
          ) -> tuple[str, list[int]]:
    msgs = [m.to_template() for m in req.messages]
    tools = [t.to_template() for t in req.tools] if fmt is not None else None
    try:
        if override is not None:
            from transformers.utils.chat_template_utils import render_jinja_template

            special = {k: getattr(tok, k, None) for k in ("bos_token", "eos_token")}
            rendered, _ = render_jinja_template([msgs], tools=tools, chat_template=override,
                                                add_generation_prompt=True, **special)
            text = rendered[0]
            return text, tok.encode(text, add_special_tokens=False)
        if getattr(tok, "has_chat_template", False):
            kw = {"tools": tools} if tools else {}
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, **kw)
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                           **kw)
            return text, list(ids)
    except jinja2.TemplateError as e:  # the template's own raise_exception, or a bad template
        raise RequestError(f"the chat template refused these messages: {e}",
                           param="messages") from None
    text = "\n".join(m.content for m in req.messages)
    return text, tok.encode(text)
