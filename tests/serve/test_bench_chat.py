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
                        "--max-tokens", "4", "--repeats", "2"], capture_output=True, text=True, timeout=300,
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
    assert "last/first TTFT (median of 2)" in r.stdout
    # two chats per server, each on a fresh one: turn 1 has nothing cached in either
    assert res["repeats"] == 2 and [len(v) for v in res["repeat_runs"].values()] == [2, 2]
    assert all(rows[0]["cached_tokens"] == 0 for rows in res["repeat_runs"]["cache"])
    assert [len(v) for v in res["summary"]["per_repeat"].values()] == [2, 2]


def test_median_rows_and_ratio():
    from macfleet.bench.serve_chat import median_rows, ttft_ratio

    rep = [[{"turn": 1, "prompt_tokens": 10, "cached_tokens": 0, "ttft_ms": t1, "total_ms": 5.0},
            {"turn": 2, "prompt_tokens": 20, "cached_tokens": 9, "ttft_ms": t2, "total_ms": 7.0}]
           for t1, t2 in ((100.0, 150.0), (300.0, 120.0), (200.0, 900.0))]
    rows = median_rows(rep)
    assert [r["ttft_ms"] for r in rows] == [200.0, 150.0]
    assert rows[1]["prompt_tokens"] == 20 and rows[1]["cached_tokens"] == 9
    assert ttft_ratio(rep[0]) == 1.5 and ttft_ratio(rows) == 0.75
