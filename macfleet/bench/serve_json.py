"""`macfleet bench serve --json-schema`: structured output through the `openai` package against
`serve --local` (results/serve_json.json; issue 32).

For each question the same request is sent free (no `response_format`) and bound to a JSON
schema, greedy, on two servers: the default drafter (n-gram) and none (`--proposer none`: the
grammar's forced tokens are the only drafts). Per answer: completion tokens, verifier steps
(`usage.verify_steps`, macfleet's), tokens per step, drafts accepted (forced tokens included),
wall time, whether it is valid against the schema, and whether the free answer is the same
text (the questions show the wanted JSON's shape, so the free answer often is the same JSON:
then the steps compare decoding of the same answer, constrained and not).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from macfleet.bench.serve import start_server, stop_server

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "skills"],
          "properties": {"name": {"type": "string", "maxLength": 32},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "maxLength": 32},
                         "skills": {"type": "array", "maxItems": 4,
                                    "items": {"type": "string", "maxLength": 24}}}}
SHAPE = '{"name": "...", "age": 0, "city": "...", "skills": ["...", "..."]}'
PEOPLE = ("Alice, 30, a painter in Paris who also cooks",
          "Bob, 41, a carpenter from Rome who plays chess",
          "Carol, 25, a nurse in London who runs marathons",
          "Dan, 52, a baker from Oslo who sings and sails",
          "Eve, 35, a pilot in Madrid who paints",
          "Frank, 60, a teacher from Lisbon who gardens")


def _question(person: str) -> str:
    return f"Write a JSON record for {person}, in exactly this shape: {SHAPE}. JSON only."


def _valid(text: str) -> bool:
    """Valid against SCHEMA (jsonschema when installed, else json and the schema's rules)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
                and isinstance(obj["name"], str) and isinstance(obj["age"], int)
                and isinstance(obj["city"], str) and isinstance(obj["skills"], list))
    try:
        jsonschema.validate(obj, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def ask(url: str, model: str, question: str, max_tokens: int, schema: bool) -> dict:
    """One greedy answer through the openai package: its text and what it cost."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
    extra = ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}} if schema else {})
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                       messages=[{"role": "user", "content": question}],
                                       **extra)
    ms = (time.perf_counter() - t0) * 1e3
    u = r.usage
    steps = (u.model_extra or {}).get("verify_steps") or 0
    details = u.completion_tokens_details
    text = r.choices[0].message.content or ""
    return {"text": text, "finish_reason": r.choices[0].finish_reason,
            "tokens": u.completion_tokens, "steps": steps,
            "tokens_per_step": round(u.completion_tokens / steps, 3) if steps else None,
            "accepted": (details.accepted_prediction_tokens or 0) if details else 0,
            "ms": round(ms, 1), "valid": _valid(text)}


def bench_json_schema(model: str, questions: int = len(PEOPLE), max_tokens: int = 96,
                      progress: Callable[[str], None] = lambda m: None) -> dict:
    """Every question free and schema-bound, on the n-gram server and the drafter-less one."""
    qs = [_question(p) for p in PEOPLE[:questions]]
    servers = {}
    for proposer in ("ngram", "none"):
        proc, url = start_server(model, "--proposer", proposer)
        try:
            ask(url, model, "Say hello.", 2, schema=False)  # warm-up (first forward)
            ask(url, model, qs[0], 4, schema=True)  # and the grammar engine's tokenizer
            rows = []
            for i, q in enumerate(qs):
                free, bound = (ask(url, model, q, max_tokens, s) for s in (False, True))
                rows.append({"question": i, "free": free, "schema": bound,
                             "same_answer": free["text"].strip() == bound["text"].strip()})
                progress(f"{proposer} q{i}: tokens/step free {free['tokens_per_step']}, "
                         f"schema {bound['tokens_per_step']} (valid {bound['valid']}, "
                         f"same answer {rows[-1]['same_answer']})")
            servers[proposer] = rows
        finally:
            stop_server(proc)
    return {"model": model, "max_tokens": max_tokens, "schema": SCHEMA, "runs": servers,
            "summary": {p: _summary(rows) for p, rows in servers.items()}}


def _summary(rows: list[dict]) -> dict:
    def per_step(key: str, only_same: bool = False) -> float | None:
        pick = [r[key] for r in rows if r[key]["steps"] and (r["same_answer"] or not only_same)]
        steps = sum(x["steps"] for x in pick)
        return round(sum(x["tokens"] for x in pick) / steps, 3) if steps else None

    return {"answers": len(rows), "schema_valid": sum(r["schema"]["valid"] for r in rows),
            "free_valid": sum(r["free"]["valid"] for r in rows),
            "same_answers": sum(r["same_answer"] for r in rows),
            "tokens_per_step_free": per_step("free"),
            "tokens_per_step_schema": per_step("schema"),
            "tokens_per_step_free_same": per_step("free", True),
            "tokens_per_step_schema_same": per_step("schema", True),
            "ms_free": round(sum(r["free"]["ms"] for r in rows), 1),
            "ms_schema": round(sum(r["schema"]["ms"] for r in rows), 1)}


def json_rows(res: dict) -> list[str]:
    out = ["drafter  answers  schema-valid  free-valid  same  tok/step free  tok/step schema  "
           "(same answers: free, schema)"]
    for p, s in res["summary"].items():
        out.append(f"{p:7s}  {s['answers']:>7}  {s['schema_valid']:>12}  {s['free_valid']:>10}  "
                   f"{s['same_answers']:>4}  {s['tokens_per_step_free']!s:>13}  "
                   f"{s['tokens_per_step_schema']!s:>15}  ({s['tokens_per_step_free_same']}, "
                   f"{s['tokens_per_step_schema_same']})")
    return out
