"""`macfleet bench serve --json-schema`: the structured-output bench end to end on a tiny model
(two real servers, the `openai` package): every question free and schema-bound per drafter, the
verifier steps read from the server's usage. The tiny models' character tokenizer has no
braces, so their schema-bound requests are refused (400) and recorded so:
the plumbing is what this checks; smollm2's numbers come from the command in the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from macfleet.bench.serve_json import SCHEMA, _shared, _summary, _valid


def test_validity_and_summary_count_tokens_per_step_of_same_answers():
    ok = json.dumps({"name": "A", "age": 3, "city": "P", "skills": ["x"]})
    assert _valid(ok) and not _valid('{"name": "A"}') and not _valid("{")
    assert not _valid(json.dumps({**json.loads(ok), "extra": 1}))  # additionalProperties
    row = {"tokens": 10, "steps": 5, "valid": True, "ms": 1.0}
    rows = [{"free": {**row, "steps": 10}, "schema": row, "compact": row, "same_answer": True},
            {"free": {**row, "tokens": 30, "steps": 10}, "schema": {**row, "steps": 2},
             "compact": {**row, "valid": False}, "same_answer": False}]
    s = _summary(rows)
    assert s["tokens_per_step_free"] == 2.0 and s["tokens_per_step_schema"] == round(20 / 7, 3)
    assert s["tokens_per_step_free_same"] == 1.0 and s["tokens_per_step_schema_same"] == 2.0
    assert s["schema_valid"] == 2 and s["same_answers"] == 1 and s["compact_valid"] == 1
    assert s["tokens_per_step_compact"] == 2.0
    assert _shared("abcd", "abxy") == 0.5 and _shared("ab", "ab") == 1.0 and _shared("", "") == 1
    assert SCHEMA["required"] == ["name", "age", "city", "skills"]


@pytest.mark.slow  # two `macfleet serve` processes
def test_bench_serve_json_schema_writes_rows_per_drafter(tmp_path):
    r = subprocess.run([sys.executable, "-m", "macfleet", "bench", "--model", "tiny:1",
                        "--out", str(tmp_path), "serve", "--json-schema", "--questions", "2",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "serve_json.json").read_text())
    assert set(res["runs"]) == {"ngram", "none"}
    for rows in res["runs"].values():
        assert [x["question"] for x in rows] == [0, 1]
        for x in rows:
            # the tiny tokenizer cannot write '{': the grammar check refuses the request before
            # it is admitted (a 400 naming response_format, recorded as refused), and the free
            # answer gets as many tokens (at least one)
            for bound in (x["schema"], x["compact"]):
                assert bound["finish_reason"].startswith("refused: ")
                assert "response_format" in bound["finish_reason"] and not bound["steps"]
            assert x["free"]["tokens"] == max(1, x["schema"]["tokens"]) and x["free"]["steps"]
    assert "tok/step free" in r.stdout
