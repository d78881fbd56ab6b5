"""`macfleet generate`, `doctor` and `demo` as a user runs them (subprocesses).

All the commands start at once (one module fixture) so their interpreter and model start-up
overlap instead of adding up; each test then reads its own result. Of the wrong invocations one
runs as a process (the exit status and stderr `python -m macfleet` gives); the others go
through the same entry point in this process (`main`: the same parser and error path, not an
interpreter and the CLI's imports each: ~1.5 s of CPU apiece).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from verify_table import keep_verify_table

from macfleet.engine.models import embedded_model_path

pytestmark = pytest.mark.slow

TIMEOUT_S = 150
COMMANDS = {
    "generate": ["generate", "What is the capital of France?", "--json", "--max-tokens", "20"],
    "doctor": ["doctor", "--json"],
    "demo": ["demo", "--max-tokens", "8"],  # the README's main job, shortened
    "bad_temp": ["generate", "hi", "--temp", "-1"],
}
# the wrong invocations run in this process, through the same entry point (macfleet.cli.main)
IN_PROCESS = {
    "bad_draft_tokens": ["generate", "hi", "--draft-tokens", "x"],
    "bad_model": ["generate", "hi", "--model", "nope.gguf"],
    "bad_proposer": ["generate", "hi", "--proposer", "foo"],
}


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


@pytest.fixture(scope="module")
def cli() -> dict[str, Result]:
    if embedded_model_path() is None:
        pytest.skip("the embedded model is not installed")
    # smollm2's verify(L) table measured once here and kept in the run's cache: `generate` and
    # the demo's verifier agent read it instead of measuring their own (tests/verify_table.py)
    keep_verify_table("smollm2", load=False)
    env = dict(os.environ)
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "macfleet", *argv], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, argv in COMMANDS.items()
    }
    results = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=TIMEOUT_S)
            results[name] = Result(p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_generate_json(cli):
    r = cli["generate"]
    assert r.rc == 0, r.err
    lines = [ln for ln in r.out.splitlines() if ln.strip()]
    assert len(lines) == 1, r.out  # exactly one JSON object, nothing else on stdout
    obj = json.loads(lines[0])
    assert set(obj) >= {"text", "token_ids", "stats"}
    assert "Paris" in obj["text"]
    ids = obj["token_ids"]
    assert ids and all(isinstance(t, int) for t in ids) and len(ids) <= 20
    st = obj["stats"]
    for key in ("tokens", "tokens_per_s", "acceptance", "mean_accepted", "blocks"):
        assert key in st, key
    assert st["tokens"] == len(ids)
    assert st["tokens_per_s"] > 0
    assert 0.0 <= st["acceptance"] <= 1.0
    assert st["finish_reason"] == "stop"
    # every block commits >= 1 token; the end-of-sequence token ends the answer without being
    # part of it, so its block can be one more than the tokens (when no draft was accepted:
    # drafting follows measured timings, so this varies from run to run)
    assert 1 <= st["blocks"] <= st["tokens"] + 1
    assert "Traceback" not in r.err


@pytest.mark.parametrize("name,words", [
    ("bad_temp", ["--temp must be >= 0"]),
    ("bad_draft_tokens", ["--draft-tokens", "'x'"]),
    ("bad_model", ["nope.gguf"]),
    ("bad_proposer", ["foo"]),
])
def test_bad_arguments_exit_2_with_one_line(cli, capsys, name, words):
    if name in IN_PROCESS:
        from macfleet.cli.main import main

        rc = main(list(IN_PROCESS[name]))
        out, err = capsys.readouterr()
        r = Result(rc, out, err)
    else:
        r = cli[name]
    assert r.rc == 2, (r.rc, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1, r.err
    assert lines[0].startswith("macfleet: error: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    assert r.out == ""


def test_doctor_json(cli):
    r = cli["doctor"]
    assert r.rc == 0, r.err
    facts = json.loads(r.out)
    for key in ("python", "platform", "mlx", "mlx_device", "blas", "embedded_model",
                "memory_total_gb"):
        assert key in facts, key
    assert facts["embedded_model"].endswith(".gguf")
    assert facts["embedded_model_mb"] > 10


def test_demo_runs_a_fleet_and_reports_identical_output(cli):
    r = cli["demo"]
    assert r.rc == 0, r.err[-2000:]
    assert "Traceback" not in r.err
    assert "discovered over Zeroconf" in r.err
    last = [ln for ln in r.out.splitlines() if "verifier alone:" in ln]
    assert len(last) == 1, r.out
    # both rounds of each side are shown, and every run's tokens were the same
    assert "the faster of 2 interleaved runs each" in last[0], last[0]
    assert "output identical to the verifier alone" in last[0], last[0]
