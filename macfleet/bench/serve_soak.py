"""`macfleet bench serve-soak`: many requests of misbehaving clients against one server.

A mix of well-behaved requests (streaming and not), clients that disconnect mid-stream,
clients whose read timeout is shorter than the answer, and bad requests (broken JSON, wrong
types, unknown model, oversize bodies). A request *fails* when a well-behaved one does not get
its full answer, or a bad one does not get an OpenAI-shaped 4xx; at the end every session must
be freed and the server still healthy.
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

KINDS = (("ok", 45), ("ok_stream", 20), ("disconnect", 12), ("timeout", 8), ("bad_json", 5),
         ("bad_param", 5), ("bad_model", 3), ("oversize", 2))
MAX_TOKENS = 24


def _bad_ok(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return 400 <= r.status_code < 500 and {"message", "type", "param", "code"} <= set(err)


def one(url: str, kind: str, rng: random.Random) -> bool:
    """Run one request of this kind; True when the server behaved."""
    body = {"messages": [{"role": "user", "content": f"request {rng.random():.6f}"}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    chat = url + "/chat/completions"
    try:
        if kind == "ok":
            r = httpx.post(chat, json=body, timeout=60)
            return r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        if kind == "ok_stream":
            with httpx.stream("POST", chat, json={**body, "stream": True}, timeout=60) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            return r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) > 2
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


def soak(model: str, requests: int, concurrency: int, time_limit_s: float,
         progress: Callable[[str], None], seed: int = 0) -> dict:
    rng = random.Random(seed)
    kinds = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS], k=requests)
    proc, url = start_server(model, "--proposer", "ngram", "--max-sessions-per-client", "64")
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
            ok = one(url, nxt[1], wrng)
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
    finally:
        stop_server(proc)
    res = {"model": model, "requests": sum(done.values()), "asked": requests,
           "concurrency": concurrency, "seconds": round(time.perf_counter() - t0, 1),
           "by_kind": dict(done), "failed_by_kind": dict(failed),
           "failed": sum(failed.values()), "server_alive_at_end": alive,
           "sessions_left_at_end": health.get("active_sessions", -1)
           + health.get("waiting_sessions", 0)}
    progress(json.dumps({k: res[k] for k in ("requests", "failed", "server_alive_at_end",
                                              "sessions_left_at_end", "seconds")}))
    return res
