"""The HTTP door of `bench security`'s fuzz campaign: hostile requests against a live server.

A real `macfleet serve --local` process (tiny model, API key set) gets, per category, requests
no client library would send: random bytes, broken and deeply nested JSON, every field of the
wrong type, out-of-range numbers, huge bodies and prompts, lone surrogates, wrong methods and
routes, missing or wrong keys; valid requests are interleaved and must still be answered. A
reply counts as *typed* when it is an OpenAI-shaped error (4xx with message/type/param/code),
or a 200 to a request the API accepts; a *crash* is the server process gone, a *hang* a reply
slower than HANG_S.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable

import httpx

from macfleet.bench.serve import start_server, stop_server
from macfleet.bench.watch import HANG_S, rss_mib

API_KEY = "fuzz-key"
MODEL = "tiny:1"


def _body(rng: random.Random) -> dict:
    return {"messages": [{"role": "user", "content": f"hi {rng.random():.4f}"}],
            "max_tokens": 4, "temperature": 0}


def _wrong_types(rng: random.Random) -> dict:
    b = _body(rng)
    field = rng.choice(["messages", "max_tokens", "temperature", "top_p", "stream", "stop",
                        "seed", "model", "n"])
    b[field] = rng.choice([[], {}, "x" * rng.randint(0, 40), -1, 1e308, None, [1, [2]], True])
    if field == "messages" and rng.random() < 0.5:
        b["messages"] = [{"role": rng.choice(["user", "root", 5]), "content": {"a": 1}}]
    return b


def _out_of_range(rng: random.Random) -> dict:
    b = _body(rng)
    k, v = rng.choice([("max_tokens", -5), ("max_tokens", 10**12), ("temperature", -1.0),
                       ("temperature", float("1e300")), ("top_p", 2.0), ("top_p", -0.5),
                       ("seed", -(2**70)), ("stop", ["x"] * 1000), ("n", 50)])
    b[k] = v
    return b


def request(client: httpx.Client, url: str, cat: str, rng: random.Random
            ) -> tuple[str, str, dict, bytes | None, dict | None]:
    """(method, path, headers, raw body or None, json body or None) of one hostile request."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    chat = "/chat/completions"
    jh = {**auth, "Content-Type": "application/json"}
    if cat == "random_bytes":
        return "POST", chat, jh, rng.randbytes(rng.randint(0, 4096)), None
    if cat == "broken_json":
        s = json.dumps(_body(rng))
        return "POST", chat, jh, s[: rng.randint(0, len(s) - 1)].encode(), None
    if cat == "deep_nesting":
        d = rng.randint(500, 100_000)
        return "POST", chat, jh, ("[" * d + "]" * d).encode(), None
    if cat == "wrong_types":
        return "POST", rng.choice([chat, "/completions"]), auth, None, _wrong_types(rng)
    if cat == "out_of_range":
        return "POST", chat, auth, None, _out_of_range(rng)
    if cat == "huge_body":
        return "POST", chat, jh, b'{"messages": "' + b"x" * (3 << 20) + b'"}', None
    if cat == "huge_prompt":
        b = _body(rng)
        b["messages"][0]["content"] = "word " * rng.randint(20_000, 200_000)
        return "POST", chat, auth, None, b
    if cat == "lone_surrogates":
        return "POST", chat, jh, b'{"messages": [{"role": "user", "content": "\\ud800\\udfff' \
            b'\\ud800"}], "max_tokens": 2}', None
    if cat == "wrong_route":
        return (rng.choice(["GET", "PUT", "DELETE", "PATCH"]),
                rng.choice([chat, "/models/../../etc/passwd", "/nope", "/completions"]),
                auth, None, None)
    if cat == "no_key":
        return "POST", chat, {}, None, _body(rng)
    if cat == "wrong_key":
        return "POST", chat, {"Authorization": f"Bearer {rng.random()}"}, None, _body(rng)
    if cat == "valid":
        return "POST", chat, auth, None, _body(rng)
    raise ValueError(cat)


CATEGORIES = ("random_bytes", "broken_json", "deep_nesting", "wrong_types", "out_of_range",
              "huge_body", "huge_prompt", "lone_surrogates", "wrong_route", "no_key",
              "wrong_key", "valid")


def typed(cat: str, r: httpx.Response) -> bool:
    """Did the server answer this request as the API says it should? (pure)"""
    if cat == "valid":
        return r.status_code == 200
    if r.status_code == 200:  # some wrong-looking values are valid; lone surrogates are
        # legal JSON escapes, answered like any other text
        return cat in ("wrong_types", "out_of_range", "lone_surrogates")
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return 400 <= r.status_code < 500 and {"message", "type", "param", "code"} <= set(err)


def http_door(per_category: int, rng: random.Random,
              progress: Callable[[str], None] = lambda m: None) -> dict:
    proc, url = start_server(MODEL, "--api-key", API_KEY)
    rss0 = rss_mib(proc.pid)
    cats: dict[str, dict] = {}
    crashes = hangs = 0
    alive = False
    try:
        with httpx.Client(base_url=url, timeout=HANG_S) as client:
            order = [c for c in CATEGORIES for _ in range(per_category)]
            rng.shuffle(order)
            for cat in order:
                c = cats.setdefault(cat, {"messages": 0, "replies": Counter(), "untyped": 0,
                                          "hangs": 0})
                method, path, headers, raw, body = request(client, url, cat, rng)
                c["messages"] += 1
                t0 = time.monotonic()
                try:
                    r = client.request(method, path, headers=headers, content=raw, json=body)
                except httpx.TimeoutException:
                    c["hangs"] += 1
                    hangs += 1
                    continue
                except httpx.TransportError:
                    if proc.poll() is not None:
                        crashes += 1
                        progress(f"the server died on a {cat} request")
                        break
                    c["replies"]["connection_closed"] += 1
                    continue
                if time.monotonic() - t0 > HANG_S:
                    c["hangs"] += 1
                    hangs += 1
                c["replies"][str(r.status_code)] += 1
                if not typed(cat, r):
                    c["untyped"] += 1
            alive = proc.poll() is None and client.get(
                url.removesuffix("/v1") + "/health").status_code == 200
    finally:
        rss1 = rss_mib(proc.pid) if proc.poll() is None else float("nan")
        stop_server(proc)
    refusals: Counter[str] = Counter()
    for c in cats.values():
        refusals.update(c["replies"])
        c["replies"] = dict(c["replies"])
    return {"server": f"macfleet serve --local --model {MODEL} --api-key ...",
            "messages": sum(c["messages"] for c in cats.values()), "crashes": crashes,
            "hangs": hangs, "alive_at_end": alive,
            "untyped": sum(c["untyped"] for c in cats.values()),
            "rss_before_mib": rss0, "rss_after_mib": rss1, "categories": cats,
            "refusals": dict(refusals)}
