"""`prediction` (OpenAI's Predicted Outputs): the answer a client expects, checked at the edge
and tokenised once; the engine drafts from it and never imposes it, so an answer is the same
with or without one. `usage_details` reports it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from macfleet.serve.schemas import Limits, RequestError, text_content


def parse_prediction(body: Mapping[str, Any]) -> str:
    """`prediction`: `{type: "content", content: "..." | [{type: text, text}, ...]}`; ""
    when absent. A wrong shape is a 400 naming the field."""
    v = body.get("prediction")
    if v is None:
        return ""
    where = "prediction"
    if not isinstance(v, dict):
        raise RequestError(f"'{where}' must be an object {{type: content, content}}",
                           param=where)
    if v.get("type") != "content":
        raise RequestError(f"'{where}.type' must be 'content'", param=f"{where}.type")
    return text_content(v.get("content"), f"{where}.content")


def prediction_ids(tokenizer, text: str, limits: Limits) -> tuple[int, ...]:
    """The prediction's token ids (no special tokens), within the server's limit."""
    if not text:
        return ()
    ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
    if len(ids) > limits.max_prediction_tokens:
        raise RequestError(f"'prediction.content' is {len(ids)} tokens, over this server's "
                           f"{limits.max_prediction_tokens}", param="prediction.content")
    return ids


def usage_details(stats) -> dict:
    """`completion_tokens_details` and macfleet's own drafting figures of an answer (`stats`:
    its GenerationStats-like Outcome)."""
    return {"completion_tokens_details": {
                "accepted_prediction_tokens": stats.prediction_accepted,
                "rejected_prediction_tokens": stats.prediction_rejected},
            "macfleet": {  # every drafter's tokens verified and accepted, verifier forwards
                "draft_tokens": stats.drafted,
                "accepted_draft_tokens": stats.accepted,
                "verify_steps": stats.blocks}}
