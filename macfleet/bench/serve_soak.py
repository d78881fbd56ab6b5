"""`macfleet bench serve-soak`: many requests of misbehaving clients against one server.

A mix of well-behaved requests (streaming and not), clients that disconnect mid-stream,
clients whose read timeout is shorter than the answer, and bad requests (broken JSON, wrong
types, unknown model, oversize bodies). A request *fails* when a well-behaved one does not get
its full answer, or a bad one does not get an OpenAI-shaped 4xx; at the end every session must
be freed and the server still healthy.

Answers are checked, not only counted: well-behaved requests ask one of a few prompts (greedy)
whose answers were taken one at a time before the soak, and the server runs batch-invariant
(`--batch-invariant`: each session's arithmetic is the one it has alone), so a lost or
corrupted answer is any difference. The server's RSS and open files are sampled after those
reference answers and a warm-up burst from every client at once, and once it is idle again
after the soak: both must stay flat.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx

from macfleet.bench.serve import start_server, stop_server
from macfleet.bench.soak import MAX_RSS_GROWTH, SETTLE_S, proc_fds, proc_rss

KINDS = (("ok", 45), ("ok_stream", 20), ("disconnect", 12), ("timeout", 8), ("bad_json", 5),
         ("bad_param", 5), ("bad_model", 3), ("oversize", 2))
MAX_TOKENS = 24
PROMPTS = tuple(f"request {i}: say something" for i in range(8))


def _bad_ok(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return 400 <= r.status_code < 500 and {"message", "type", "param", "code"} <= set(err)


def _body(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0}


def reference(url: str, prompt: str) -> str:
    """The answer to one prompt asked alone."""
    r = httpx.post(url + "/chat/completions", json=_body(prompt), timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def one(url: str, kind: str, rng: random.Random, want: dict[str, str] | None = None) -> bool:
    """Run one request of this kind; True when the server behaved (and, given `want`, a
    well-behaved request got exactly the reference answer to its prompt)."""
    prompt = rng.choice(PROMPTS)
    body = _body(prompt)
    chat = url + "/chat/completions"
    try:
        if kind == "ok":
            r = httpx.post(chat, json=body, timeout=60)
            return (r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0 and
                    (want is None or r.json()["choices"][0]["message"]["content"] == want[prompt]))
        if kind == "ok_stream":
            with httpx.stream("POST", chat, json={**body, "stream": True}, timeout=60) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                           for ln in lines[:-1])
            return (r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) > 2 and
                    (want is None or text == want[prompt]))
        if kind == "disconnect":
            with httpx.stream("POST", chat, json={**body, "stream": True, "max_tokens": 200},
                              timeout=60) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 3:
                        break  # leaving the block closes the connection mid-answer
            return r.status_code == 200
        if kind == "timeout":
            try:
                httpx.post(chat, json={**body, "max_tokens": 200}, timeout=0.05)
            except httpx.TimeoutException:
                pass
            return True
        if kind == "bad_json":
            return _bad_ok(httpx.post(chat, content=b'{"messages": [', timeout=30,
                                      headers={"Content-Type": "application/json"}))
        if kind == "bad_param":
            return _bad_ok(httpx.post(chat, json={**body, "max_tokens": "many"}, timeout=30))
        if kind == "bad_model":
            return _bad_ok(httpx.post(chat, json={**body, "model": "gpt-9"}, timeout=30))
        if kind == "oversize":
            return _bad_ok(httpx.post(chat, content=b"x" * (2 << 20), timeout=30))
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        return kind == "timeout" and isinstance(e, httpx.TimeoutException)
    raise ValueError(kind)


def _warm_up(url: str, concurrency: int, want: dict[str, str], rounds: int = 3) -> None:
    """Well-behaved requests from `concurrency` clients at once, not counted."""
    ts = [threading.Thread(target=lambda i=i: [one(url, "ok_stream", random.Random(-1 - i), want)
                                               for _ in range(rounds)], daemon=True)
          for i in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)


def soak(model: str, requests: int, concurrency: int, time_limit_s: float,
         progress: Callable[[str], None], seed: int = 0) -> dict:
    rng = random.Random(seed)
    kinds = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS], k=requests)
    proc, url = start_server(model, "--proposer", "ngram", "--max-sessions-per-client", "64",
                             "--batch-invariant")
    want = {p: reference(url, p) for p in PROMPTS}
    _warm_up(url, concurrency, want)  # batches of every size allocated before the baseline
    rss0, fds0 = proc_rss(proc.pid), proc_fds(proc.pid)
    done: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    lock = threading.Lock()
    it = iter(enumerate(kinds))
    deadline = time.monotonic() + time_limit_s

    def worker(wid: int) -> None:
        wrng = random.Random(seed * 1000 + wid)
        while time.monotonic() < deadline:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            ok = one(url, nxt[1], wrng, want)
            with lock:
                done[nxt[1]] += 1
                if not ok:
                    failed[nxt[1]] += 1

    t0 = time.perf_counter()
    try:
        ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(max(1.0, deadline - time.monotonic() + 60))
        health = {}
        t_idle = time.monotonic() + 30
        while time.monotonic() < t_idle:
            health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()
            if not health["active_sessions"] and not health["waiting_sessions"]:
                break
            time.sleep(0.2)
        alive = proc.poll() is None
        if alive:
            time.sleep(SETTLE_S)  # closed connections' fds are released asynchronously
            rss1, fds1 = proc_rss(proc.pid), proc_fds(proc.pid)
        else:
            rss1, fds1 = 0, -1
    finally:
        stop_server(proc)
    growth = (rss1 - rss0) / rss0 if rss0 else 0.0
    res = {"model": model, "requests": sum(done.values()), "asked": requests,
           "concurrency": concurrency, "seconds": round(time.perf_counter() - t0, 1),
           "by_kind": dict(done), "failed_by_kind": dict(failed),
           "failed": sum(failed.values()), "server_alive_at_end": alive,
           "sessions_left_at_end": health.get("active_sessions", -1)
           + health.get("waiting_sessions", 0),
           "answers_checked_against": "each prompt answered alone before the soak "
                                      "(greedy, batch-invariant server)",
           "rss_before_mib": round(rss0 / 2**20, 1), "rss_after_mib": round(rss1 / 2**20, 1),
           "rss_growth": round(growth, 4), "fds_before": fds0, "fds_after": fds1,
           "max_rss_growth": MAX_RSS_GROWTH,
           "flat": alive and growth < MAX_RSS_GROWTH and 0 <= fds1 <= fds0}
    progress(json.dumps({k: res[k] for k in ("requests", "failed", "server_alive_at_end",
                                              "sessions_left_at_end", "seconds", "rss_before_mib",
                                              "rss_after_mib", "fds_before", "fds_after")}))
    return res
