"""`macfleet bench serve --multi-turn`: one chat of N turns with a growing history, through the
`openai` package, against `serve --local` with its prompt cache and without (results/serve_chat.json).

Each turn sends the whole conversation (a client's only way: the API is stateless) plus a new
user message carrying a paragraph of text, streams the answer and records the time to the first
token, the prompt's tokens and the ones the server reused (`usage.prompt_tokens_details.
cached_tokens`). Without a cache every turn prefills the whole history, so TTFT grows with it;
with one, a turn prefills only what is new (issue 32's goal: turn 8 within 1.5x of turn 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import statistics

from macfleet.bench.serve import start_mlx_lm_server, start_server, stop_server

DEFAULT_TURNS = 8
GOAL_RATIO = 1.5  # last turn's TTFT over the first's, with the cache
PARAGRAPHS = (
    "Rivers carve valleys over thousands of years. Water picks up sand and stones, and the "
    "moving load grinds the bed deeper, while floods widen the banks and leave fertile plains.",
    "A compiler reads source text, builds a syntax tree, checks types, and lowers the program "
    "through several intermediate forms before it chooses machine instructions and registers.",
    "Bees find flowers by colour and scent, and tell the hive where the food is with a dance: "
    "the angle gives the direction against the sun and the length tells the distance.",
    "The first railways ran on wooden rails pulled by horses; steam engines came later and "
    "changed how quickly goods and people could cross a country, and where towns grew.",
)


def _question(turn: int) -> str:
    p = PARAGRAPHS[turn % len(PARAGRAPHS)]
    return f"Here is a note ({turn + 1}): {p} {p} Summarise it in one sentence."


def chat_turns(url: str, model: str, turns: int, max_tokens: int,
               progress: Callable[[str], None] = lambda m: None, label: str = "") -> list[dict]:
    """One conversation: per turn {turn, prompt_tokens, cached_tokens, ttft_ms, total_ms}
    (cached_tokens 0 where the server does not report them: mlx_lm.server)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
    # warm-up (first forward, kernel compilation) on an unrelated prompt
    client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "Say hello."}])
    msgs = [{"role": "system", "content": "You are a concise assistant."}]
    rows = []
    for turn in range(turns):
        msgs.append({"role": "user", "content": _question(turn)})
        t0 = time.perf_counter()
        ttft, text, usage = None, [], None
        for chunk in client.chat.completions.create(
                model=model, messages=msgs, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        total = time.perf_counter() - t0
        details = getattr(usage, "prompt_tokens_details", None)
        rows.append({"turn": turn + 1, "prompt_tokens": usage.prompt_tokens if usage else 0,
                     "cached_tokens": (details.cached_tokens or 0) if details else 0,
                     "ttft_ms": round((ttft if ttft is not None else total) * 1e3, 1),
                     "total_ms": round(total * 1e3, 1)})
        progress(f"{label} turn {turn + 1}: {rows[-1]['prompt_tokens']} prompt tokens "
                 f"({rows[-1]['cached_tokens']} cached), TTFT {rows[-1]['ttft_ms']:.0f} ms")
        msgs.append({"role": "assistant", "content": "".join(text)})
    return rows


def ttft_ratio(rows: list[dict]) -> float:
    """The last turn's time to first token over the first's (pure)."""
    return round(rows[-1]["ttft_ms"] / max(rows[0]["ttft_ms"], 1e-3), 2)


def median_rows(repeats: list[list[dict]]) -> list[dict]:
    """Per turn, the median of each timing over the repeats (pure; token counts: the first
    repeat's, which greedy decoding makes the same in every repeat)."""
    out = []
    for turn_rows in zip(*repeats):
        row = dict(turn_rows[0])
        for k in ("ttft_ms", "total_ms"):
            row[k] = round(statistics.median(r[k] for r in turn_rows), 1)
        out.append(row)
    return out


def bench_multi_turn(model: str, turns: int = DEFAULT_TURNS, max_tokens: int = 32,
                     progress: Callable[[str], None] = lambda m: None,
                     cache_mb: int = 512, repeats: int = 1,
                     mlx_lm_dir: str | None = None) -> dict:
    """The same chat against `serve --local` with its prompt cache on (cache_mb) and off, and
    (mlx_lm_dir) `mlx_lm.server`, whose prompt cache is on by default, on the same weights
    exported: `repeats` rounds, the servers in turn within a round, each chat on a fresh
    server (an empty cache). The ratio of a mode is the median of its rounds' ratios."""
    modes = [("cache", cache_mb), ("no_cache", 0)] + ([("mlx_lm_server", None)]
                                                        if mlx_lm_dir else [])
    got: dict[str, list[list[dict]]] = {m: [] for m, _ in modes}
    for r in range(repeats):
        for mode, mb in modes:
            proc, url = (start_mlx_lm_server(mlx_lm_dir) if mb is None
                         else start_server(model, "--prompt-cache-mb", str(mb)))
            try:
                got[mode].append(chat_turns(url, "default_model" if mb is None else model,
                                            turns, max_tokens, progress, f"{mode} #{r + 1}"))
            finally:
                stop_server(proc)
    ratios = {m: [ttft_ratio(rows) for rows in reps] for m, reps in got.items()}
    summary = {m: round(statistics.median(v), 2) for m, v in ratios.items()}
    return {"model": model, "turns": turns, "max_tokens": max_tokens, "cache_mb": cache_mb,
            "repeats": repeats, "runs": {m: median_rows(reps) for m, reps in got.items()},
            "repeat_runs": got,
            "summary": {"ttft_last_over_first": summary, "per_repeat": ratios,
                        "goal_ratio": GOAL_RATIO,
                        "meets_goal": summary["cache"] <= GOAL_RATIO,
                        "cached_tokens_total": sum(r["cached_tokens"]
                                                   for r in got["cache"][0])}}


def chat_rows(res: dict) -> list[str]:
    """A table: TTFT per turn, cache vs no cache."""
    peer = res["runs"].get("mlx_lm_server")
    out = ["turn  prompt  cached  TTFT cache ms  TTFT no-cache ms"
           + ("  TTFT mlx_lm.server ms" if peer else "")]
    for i, (a, b) in enumerate(zip(res["runs"]["cache"], res["runs"]["no_cache"])):
        out.append(f"{a['turn']:>4}  {a['prompt_tokens']:>6}  {a['cached_tokens']:>6}  "
                   f"{a['ttft_ms']:>13.1f}  {b['ttft_ms']:>16.1f}"
                   + (f"  {peer[i]['ttft_ms']:>21.1f}" if peer else ""))
    s = res["summary"]["ttft_last_over_first"]
    out.append(f"last/first TTFT (median of {res.get('repeats', 1)}): cache {s['cache']}x, "
               f"no cache {s['no_cache']}x"
               + (f", mlx_lm.server {s['mlx_lm_server']}x" if peer else "")
               + f" (goal <= {GOAL_RATIO}x with the cache)")
    return out
