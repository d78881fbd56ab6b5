"""`macfleet bench serve --multi-turn`: the multi-turn chat bench end to end on a tiny model
(two real servers, the `openai` package): per-turn TTFT rows, cached tokens only with the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # two `macfleet serve` processes
def test_bench_serve_multi_turn_writes_per_turn_ttft_with_and_without_cache(tmp_path):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "macfleet", "bench", "--model", "tiny:1",
                        "--out", str(tmp_path), "serve", "--multi-turn", "--turns", "3",
                        "--max-tokens", "4"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "serve_chat.json").read_text())
    cache, plain = res["runs"]["cache"], res["runs"]["no_cache"]
    assert [t["turn"] for t in cache] == [1, 2, 3] == [t["turn"] for t in plain]
    # the history grows; the same prompts on both servers (greedy: the same answers)
    assert [t["prompt_tokens"] for t in cache] == [t["prompt_tokens"] for t in plain]
    assert cache[0]["prompt_tokens"] < cache[1]["prompt_tokens"] < cache[2]["prompt_tokens"]
    assert cache[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 100 for t in cache[1:])
    assert all(t["cached_tokens"] == 0 for t in plain)
    assert all(t["ttft_ms"] > 0 for t in cache + plain)
    assert set(res["summary"]["ttft_last_over_first"]) == {"cache", "no_cache"}
    assert "last/first TTFT" in r.stdout
