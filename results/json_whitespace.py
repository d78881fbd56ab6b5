"""Issue 43's structured-output check: instructor (JSON, JSON_SCHEMA and TOOLS modes) on the
embedded smollm2 through `serve --local` with the Hermes test template, greedy, max_tokens 160,
against two source trees (the code before and after the change): per call the finish reason,
completion tokens and whitespace characters of the JSON written. Writes results/json_whitespace.json.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python results/json_whitespace.py \
        OLD_TREE NEW_TREE
"""
import json
import os
import sys
import time
from typing import Literal

import instructor
import openai
from pydantic import BaseModel


class User(BaseModel):
    name: str
    age: int


class Person(BaseModel):
    name: str
    age: int
    role: str


class Extraction(BaseModel):
    people: list[Person]
    summary: str


class Address(BaseModel):
    street: str
    city: str
    country: str


class Order(BaseModel):
    customer: str
    address: Address
    items: list[str]
    priority: Literal["low", "normal", "high"]


CASES = [(User, "John Smith is 34 years old."),
         (Extraction, "John Smith is 34 and works as an engineer at Acme; Mary Jones, 29, is a "
                      "designer there."),
         (Order, "Ship two lamps and a rug to Ana Lopez, 12 Calle Mayor, Madrid, Spain, "
                 "urgently.")]
MODES = (instructor.Mode.JSON, instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS)
MAX_TOKENS = 160


def run_tree(tree: str) -> list[dict]:
    os.environ["PYTHONPATH"] = tree  # the server subprocess runs this tree's code
    os.chdir(tree)  # `python -m` puts the working directory first on sys.path
    sys.path.insert(0, os.path.join(tree, "tests", "serve"))
    import serve_testkit

    serve_testkit.START_TIMEOUT_S = 300.0
    template = os.path.join(tree, "tests", "serve", "data", "hermes_tools.jinja")
    s = serve_testkit.start_server("--chat-template", template, model="smollm2", key=None)
    rows = []
    try:
        for mode in MODES:
            ic = instructor.from_openai(openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0,
                                                      timeout=600), mode=mode)
            last = {}
            ic.on("completion:response", lambda r: last.update(r=r))
            for model, text in CASES:
                row = {"mode": mode.value, "schema": model.__name__}
                try:
                    ic.chat.completions.create(model="smollm2", temperature=0,
                                               max_tokens=MAX_TOKENS, max_retries=0,
                                               response_model=model, messages=[
                                                   {"role": "user",
                                                    "content": f"Extract it: {text}"}])
                    row["valid_object"] = True
                except Exception as e:  # the client's own verdict, recorded
                    row.update(valid_object=False, error=type(e).__name__)
                msg = last["r"].choices[0].message
                out = msg.content or "".join(c.function.arguments for c in msg.tool_calls or [])
                row.update(finish=last["r"].choices[0].finish_reason,
                           completion_tokens=last["r"].usage.completion_tokens,
                           whitespace_chars=sum(ch.isspace() for ch in out), chars=len(out),
                           text=out[:300])
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        serve_testkit.stop_server(s)
        sys.path.pop(0)
        sys.modules.pop("serve_testkit", None)
    return rows


def main() -> None:
    path = os.path.abspath(os.path.join(os.path.dirname(__file__), "json_whitespace.json"))
    out = {"command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python "
                      "results/json_whitespace.py OLD_TREE NEW_TREE  (a tree '-': kept from "
                      "the file)",
           "note": "2-core box shared with other jobs; token counts are exact, no timings",
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "trees": {}}
    if os.path.exists(path):
        with open(path) as f:
            out["trees"] = json.load(f)["trees"]
    for label, tree in zip(("before", "after"), sys.argv[1:3]):
        if tree == "-":
            continue
        tree = os.path.abspath(tree)
        rows = run_tree(tree)
        out["trees"][label] = {"rows": rows, "summary": {
            "valid_objects": sum(r["valid_object"] for r in rows), "calls": len(rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "whitespace_chars": sum(r["whitespace_chars"] for r in rows),
            "length_finishes": sum(r["finish"] == "length" for r in rows)}}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
