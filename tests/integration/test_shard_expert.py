"""Expert parallelism across real processes (mlx.distributed ring on loopback ports), on the
tiny mixture of experts (`tiny-moe:1`: 4 MoE layers, 8 experts, 2 per token, hidden 64).

* 4 ranks: greedy ids identical to the single-process model, logits within LOGIT_ATOL
  (the all_sum adds the ranks' partials in the ring's order); spec decoding (ngram drafts,
  rollbacks) on top of the expert-sharded verifier gives the same ids: 2 expert ranks,
  test_shard_expert_agents.py (the same ids, flow and router load through real agents; its
  4-rank twin here cost 5-6 s of the serial pass: docs/testing.md, ninth round);
* the shard flow is exact: one all_sum of [tokens, hidden] float32 per MoE layer, which is half
  of what tensor parallelism moves for the same forwards; the router's load adds up.

A rank killed mid-generation is test_shard.py's (the others exit with ShardPeerLost): the
watchdog guards every mode's command broadcast and forward in the same place (agents/shard.py
`ShardGroup`), so an expert ring's kill was its twin (issue 48).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_shard import env, finish, free_ports
from tolerance import LOGIT_ATOL

ROOT = Path(__file__).parents[2]
MODEL = "tiny-moe:1"
TOKENS = 12
PROMPT = "one two three, one two three, one two three,"
HIDDEN, MOE_LAYERS, EXPERTS, TOP_K = 64, 4, 8, 2

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def reference():
    from macfleet.engine.models import load_model
    from macfleet.engine.verifier import Verifier

    lm = load_model(MODEL)
    prompt = lm.tokenizer.encode(PROMPT)
    v = Verifier(lm.model)
    v.prefill(prompt[:-1])
    last, ids, rows = prompt[-1], [], []
    for _ in range(TOKENS):
        rows.append(np.array(v.forward([last])[-1]))
        last = int(rows[-1].argmax())
        ids.append(last)
    return prompt, ids, np.stack(rows)


def start(tmp: Path, mode: str, n: int, prompt, *, tokens: int = TOKENS, spec: str = "none",
          deadline: float = 60.0) -> tuple[list[subprocess.Popen], Path]:
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    out = tmp / "out.json"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "macfleet.bench.shard_run", "--hostfile", str(hostfile), "--rank", str(r),
         "--mode", mode, "--model", MODEL, "--prompt-ids", json.dumps(prompt),
         "--max-tokens", str(tokens), "--proposer", spec, "--out", str(out),
         "--deadline", str(deadline)],
        cwd=ROOT, env=env(), stderr=subprocess.PIPE, text=True) for r in range(n)]
    return procs, out


def run(tmp: Path, mode: str, n: int, prompt, spec: str = "none") -> tuple[dict, np.ndarray]:
    procs, out = start(tmp, mode, n, prompt, spec=spec)
    errs = finish(procs)
    assert all(p.returncode == 0 for p in procs), errs
    return json.loads(out.read_text()), np.load(str(out) + ".logits.npy")


def test_expert_parallel_same_ids_and_exact_flow(tmp_path, reference):
    """Four ranks of two experts each, plain decoding (two ranks of four, drafted:
    test_shard_expert_agents.py, was a parametrization of this test)."""
    prompt, ids, logits = reference
    n = 4
    res, got = run(tmp_path, "expert", n, prompt)
    assert res["plain_ids"] == ids
    np.testing.assert_allclose(got, logits, atol=LOGIT_ATOL, rtol=0)
    sh = res["plain_shard"]
    assert sh["mode"] == "expert" and sh["ranks"] == n
    # one all_sum of [tokens, hidden] float32 per MoE layer, every forward
    assert sh["collective_bytes"] == MOE_LAYERS * sh["tokens"] * HIDDEN * 4
    assert sum(sh["expert_load"]) == MOE_LAYERS * sh["tokens"] * TOP_K
    assert len(sh["rank_load"]) == n and sum(sh["rank_load"]) == sum(sh["expert_load"])
    assert sh["collective_ms"] > 0 and sh["forward_ms"] >= sh["collective_ms"]
    assert sh["tokens"] == len(prompt) - 1 + TOKENS


def test_expert_moves_half_the_bytes_of_tensor(tmp_path, reference):
    prompt, ids, logits = reference
    res, got = run(tmp_path, "tensor", 2, prompt)
    assert res["plain_ids"] == ids
    np.testing.assert_allclose(got, logits, atol=LOGIT_ATOL, rtol=0)
    sh = res["plain_shard"]
    tensor_bytes = 2 * MOE_LAYERS * sh["tokens"] * HIDDEN * 4
    assert sh["collective_bytes"] == tensor_bytes
    assert MOE_LAYERS * sh["tokens"] * HIDDEN * 4 * 2 == tensor_bytes  # expert's, twice
    # its all-reduces run inside the graph, untimed: priced at the ring's latency that rank 0
    # measured (the rounds per mode and the price: test_shard_metrics.py). Not bounded by the
    # forwards' time: on a loaded box a broadcast's wait for the followers can exceed a forward
    # (docs/testing.md, seventh round)
    assert sh["collective_ms"] == 0 and sh["priced_ms"] > 0

