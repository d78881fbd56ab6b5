"""`macfleet bench serve --json-schema`: structured output through the `openai` package against
`serve --local` (results/serve_json.json; issue 32).

For each question, greedy, on one server per drafter (`--proposer`; by default the n-gram
drafter and none: `--proposer none`, the grammar's forced tokens the only drafts; a tree
drafter such as `retrieval+ngram` keeps its trees under the grammar): the answer bound to a JSON
schema (llguidance's flexible whitespace: the model's own layout), bound to the same schema
with compact JSON (`x-guidance: {whitespace_flexible: false}`: no whitespace, so every key
and its punctuation is forced), and free (no `response_format`) with max_tokens set to the
schema-bound answer's length. The questions show the wanted JSON's shape, so the free answer
mostly starts with the same JSON: then it IS the same answer, token for token, and the steps
compare decoding of the same text constrained and not (`same_answer`). Per answer:
completion tokens, verifier steps (`usage.macfleet.verify_steps`), tokens per step, drafts
accepted (forced tokens included), wall time, validity against the schema.
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


COMPACT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}


def ask(url: str, model: str, question: str, max_tokens: int, schema: dict | None) -> dict:
    """One greedy answer through the openai package: its text and what it cost."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
    extra = ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": schema, "strict": True}}} if schema else {})
    t0 = time.perf_counter()
    try:
        r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                           messages=[{"role": "user", "content": question}],
                                           **extra)
    except openai.BadRequestError as e:  # a model whose tokens cannot follow the grammar
        return {"text": "", "finish_reason": f"refused: {e.message}"[:300], "tokens": 0,
                "steps": 0, "tokens_per_step": None, "accepted": 0, "ms": 0.0,
                "valid": False}
    ms = (time.perf_counter() - t0) * 1e3
    u = r.usage
    mine = (u.model_extra or {}).get("macfleet") or {}  # macfleet's drafting figures
    steps = mine.get("verify_steps") or 0
    text = r.choices[0].message.content or ""
    return {"text": text, "finish_reason": r.choices[0].finish_reason,
            "tokens": u.completion_tokens, "steps": steps,
            "tokens_per_step": round(u.completion_tokens / steps, 3) if steps else None,
            "accepted": mine.get("accepted_draft_tokens") or 0,
            "ms": round(ms, 1), "valid": _valid(text)}


def bench_json_schema(model: str, questions: int = len(PEOPLE), max_tokens: int = 96,
                      progress: Callable[[str], None] = lambda m: None,
                      drafters: tuple[str, ...] = ("ngram", "none")) -> dict:
    """Every question free and schema-bound, on one server per drafter (proposer spec)."""
    qs = [_question(p) for p in PEOPLE[:questions]]
    servers = {}
    for proposer in drafters:
        proc, url = start_server(model, "--proposer", proposer)
        try:
            ask(url, model, "Say hello.", 2, None)  # warm-up (first forward)
            ask(url, model, qs[0], 4, SCHEMA)  # and the grammar engine's tokenizer
            rows = []
            for i, q in enumerate(qs):
                bound = ask(url, model, q, max_tokens, SCHEMA)
                compact = ask(url, model, q, max_tokens, COMPACT)
                free = ask(url, model, q, max(1, bound["tokens"]), None)
                rows.append({"question": i, "free": free, "schema": bound, "compact": compact,
                             "same_answer": free["text"] == bound["text"],
                             "shared_prefix": _shared(free["text"], bound["text"])})
                progress(f"{proposer} q{i}: tokens/step free {free['tokens_per_step']}, "
                         f"schema {bound['tokens_per_step']}, compact "
                         f"{compact['tokens_per_step']} (valid {bound['valid']}/"
                         f"{compact['valid']}, same answer {rows[-1]['same_answer']})")
            servers[proposer] = rows
        finally:
            stop_server(proc)
    return {"model": model, "max_tokens": max_tokens, "schema": SCHEMA, "runs": servers,
            "summary": {p: _summary(rows) for p, rows in servers.items()}}


def _shared(a: str, b: str) -> float:
    """The share of b's characters that a starts with (1.0: a begins with all of b)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return round(n / len(b), 3) if b else 1.0


def _summary(rows: list[dict]) -> dict:
    def per_step(key: str, only_same: bool = False) -> float | None:
        pick = [r[key] for r in rows if r[key]["steps"] and (r["same_answer"] or not only_same)]
        steps = sum(x["steps"] for x in pick)
        return round(sum(x["tokens"] for x in pick) / steps, 3) if steps else None

    return {"answers": len(rows), "schema_valid": sum(r["schema"]["valid"] for r in rows),
            "compact_valid": sum(r["compact"]["valid"] for r in rows),
            "tokens_per_step_compact": per_step("compact"),
            "free_valid": sum(r["free"]["valid"] for r in rows),
            "same_answers": sum(r["same_answer"] for r in rows),
            "tokens_per_step_free": per_step("free"),
            "tokens_per_step_schema": per_step("schema"),
            "tokens_per_step_free_same": per_step("free", True),
            "tokens_per_step_schema_same": per_step("schema", True),
            "ms_free": round(sum(r["free"]["ms"] for r in rows), 1),
            "ms_schema": round(sum(r["schema"]["ms"] for r in rows), 1),
            "ms_compact": round(sum(r["compact"]["ms"] for r in rows), 1)}


def json_rows(res: dict) -> list[str]:
    out = ["drafter  answers  valid schema/compact  same  tok/step free  schema  compact  "
           "(same answers: free, schema)"]
    for p, s in res["summary"].items():
        out.append(f"{p:7s}  {s['answers']:>7}  {s['schema_valid']:>12}/{s['compact_valid']:<7}  "
                   f"{s['same_answers']:>4}  {s['tokens_per_step_free']!s:>13}  "
                   f"{s['tokens_per_step_schema']!s:>6}  {s['tokens_per_step_compact']!s:>7}  "
                   f"({s['tokens_per_step_free_same']}, {s['tokens_per_step_schema_same']})")
    return out
