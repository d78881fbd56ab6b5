"""The closed fleet's third pass (issue 47), as figures: four attacks, each bounded (seconds).

1. replayed_cards: a fresh local fleet (`macfleet up`: verifier + proposer, tiny:1, closed);
   the proposer's genuine card (its real fleet-key tag) is re-advertised without the key at
   other ports, two pointing at TCP relays to the real proposer (their pings answer), two at
   plain listeners. Generations through the fleet client (what `macfleet generate` runs): how
   many answered, whether the text is the one without replayed cards, and how many
   connections the replayed endpoints saw.
2. grammar_past_limits: `macfleet serve --local` and a Lark grammar of 2,000 alternatives
   (a parser row over llguidance's 2,000 items a token in): the status, field and message.
3. message_flood: twelve concurrent requests of 28,000 one-character messages (under 1 MB
   each) while `/v1/models` is asked every 50 ms: the slowest answer, beside a flood of as
   many padded bodies as large that cost nothing to decode (the transport's share).
4. cache_per_key: the server with two API keys; key A sends a prompt twice, key B once:
   each answer's `cached_tokens`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from bridge.card import ROLE_PROPOSER, AgentCard
from bridge.discovery import LOOPBACK_ONLY, Advertiser

FLOOD = 12
TINY_MESSAGES = 28_000
MODELS_EVERY_S = 0.05
KEY_A, KEY_B = "bench-key-a", "bench-key-b"
MODEL = "tiny:1"
PROMPT = "the cat sat on the mat"
GENERATIONS = 3


# -- replayed cards ----------------------------------------------------------------------
class Listener:
    """A TCP listener on 127.0.0.1 counting connections; with `to`, a relay to that port."""

    def __init__(self, to: int | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.to, self.accepted, self._open = to, 0, True
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self._open:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.to is None:
                conn.close()
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.to), timeout=5)
            except OSError:
                conn.close()
                continue
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._open = False
        self.sock.close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := a.recv(65536):
            b.sendall(data)
    with contextlib.suppress(OSError):
        b.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def replayed(card: AgentCard, port: int, tag: str) -> Iterator[Advertiser]:
    """A genuine card, its tag and stamp untouched, advertised at another port without the
    key (another node id and name, so it stands beside the genuine card)."""
    copy = replace(card, node_id=f"{card.node_id}-{tag}", name=f"replayed-{tag}",
                   router_port=port)
    adv = Advertiser(copy, interfaces=LOOPBACK_ONLY)
    try:
        yield adv
    finally:
        adv.close()


def _answer(key: bytes) -> tuple[str, str]:
    """One generation through the fleet client: ("ok" or the error, the text)."""
    from macfleet.fleet.client import Done, NoFleet, Refused, VerifierFailed, generate_fleet

    try:
        done = [e for e in generate_fleet(key, MODEL, wait_s=3, prompt=PROMPT, chat=False,
                                          max_tokens=24, proposer_spec="ngram",
                                          draft_tokens=3) if isinstance(e, Done)]
    except (NoFleet, Refused, VerifierFailed) as e:
        return f"error: {e}"[:200], ""
    return ("ok", done[-1].text) if done else ("no answer", "")


def replayed_cards(progress: Callable[[str], None]) -> dict:
    from macfleet.fleet import local
    from macfleet.fleet.keys import keygen

    with tempfile.TemporaryDirectory(prefix="macfleet-pass3-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        run_dir = Path(tmp) / "run"
        cards = local.up(2, model=MODEL, key=key, key_path=key_path, run_dir=run_dir,
                         timeout_s=60)
        try:
            proposer = next(c for c in cards if ROLE_PROPOSER in c.roles)
            ref = _answer(key)
            doors = [Listener(to=proposer.router_port), Listener(to=proposer.router_port),
                     Listener(), Listener()]
            try:
                with contextlib.ExitStack() as stack:
                    for i, door in enumerate(doors):
                        stack.enter_context(replayed(proposer, door.port, str(i)))
                    time.sleep(2.0)  # announced
                    progress(f"replayed cards: {GENERATIONS} generations beside 4 replays")
                    runs = [_answer(key) for _ in range(GENERATIONS)]
            finally:
                for door in doors:
                    door.close()
        finally:
            local.down(run_dir)
    return {"replayed": len(doors), "generations": GENERATIONS,
            "answered": sum(r[0] == "ok" for r in runs),
            "same_text": sum(r == ref for r in runs), "reference": ref[0],
            "errors": sorted({r[0] for r in runs if r[0] != "ok"}),
            "connections_to_replayed": sum(d.accepted for d in doors)}


# -- the server ------------------------------------------------------------------------
def _post(url: str, body: bytes, key: str, timeout: float = 120):
    import httpx

    return httpx.post(url + "/chat/completions", content=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}",
                               "Content-Type": "application/json"})


def grammar_past_limits(url: str) -> dict:
    lark = "start: " + " | ".join(f'"t{i}"' for i in range(2000))
    r = _post(url, json.dumps({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}], "response_format": {"type": "grammar",
                                                                 "grammar": lark}}).encode(),
              KEY_A)
    out = {"alternatives": 2000, "status": r.status_code}
    body = r.json()
    if "error" in body:
        out.update(param=body["error"]["param"], message=body["error"]["message"][:200])
    else:
        choice = body["choices"][0]
        out.update(content=choice["message"]["content"], finish=choice["finish_reason"])
    return out


def _flood(url: str, body: bytes) -> dict:
    import httpx

    stop = threading.Event()
    slow: list[float] = []

    def watch() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(url + "/models")
                slow.append(time.perf_counter() - t)
                stop.wait(MODELS_EVERY_S)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(FLOOD) as pool:
        got = list(pool.map(lambda _: _post(url, body, KEY_A), range(FLOOD)))
    wall = time.perf_counter() - t0
    stop.set()
    w.join(30)
    return {"statuses": sorted({r.status_code for r in got}),
            "codes": sorted({r.json().get("error", {}).get("code") or "" for r in got}),
            "flood_s": round(wall, 2), "models_asked": len(slow),
            "models_worst_s": round(max(slow), 3) if slow else None}


def message_flood(url: str) -> dict:
    tiny = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "a"}] * TINY_MESSAGES}).encode()
    pad = json.dumps({"model": "not-served", "messages": [{"role": "user", "content": "a"}]})
    padded = pad.encode() + b" " * (len(tiny) - len(pad))
    return {"requests": FLOOD, "messages_each": TINY_MESSAGES, "body_bytes": len(tiny),
            "padded_baseline": _flood(url, padded), "flood": _flood(url, tiny)}


def cache_per_key(url: str) -> dict:
    msgs = [{"role": "system", "content": "the launch code is " + "abcdefgh " * 12},
            {"role": "user", "content": "what is it?"}]
    body = json.dumps({"model": MODEL, "max_tokens": 4, "temperature": 0,
                       "messages": msgs}).encode()

    def cached(key: str) -> int | str:
        r = _post(url, body, key)
        if r.status_code != 200:
            return f"HTTP {r.status_code}"
        time.sleep(0.3)  # the session's KV is in the cache once it has closed
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    return {"a_first": cached(KEY_A), "a_repeat": cached(KEY_A), "b_same_prompt": cached(KEY_B),
            "b_repeat": cached(KEY_B)}


SERVED: dict[str, Callable[[str], dict]] = {
    "grammar_past_limits": grammar_past_limits, "message_flood": message_flood,
    "cache_per_key": cache_per_key}
PARTS = ("replayed_cards", *SERVED)


def third_pass(progress: Callable[[str], None] = lambda m: None,
               parts: tuple[str, ...] = PARTS) -> dict:
    """The four cases (or those named), each against fresh agents or a fresh server."""
    from macfleet.bench.serve import start_server

    t0 = time.monotonic()
    out: dict = {}
    if "replayed_cards" in parts:
        progress("replayed cards: a local fleet, its proposer's card replayed at 4 ports")
        out["replayed_cards"] = replayed_cards(progress)
    served = [p for p in parts if p != "replayed_cards"]
    if served:
        proc, url = start_server(MODEL, "--api-key", KEY_A, "--api-key", KEY_B,
                                 "--prompt-cache-mb", "64")
        try:
            for name in served:
                progress(f"{name}: macfleet serve --local --model {MODEL}, two API keys")
                out[name] = SERVED[name](url)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"what": "the third hostile pass (issue 47): replayed Zeroconf cards against the "
                    "fleet client, and a grammar past the engine's limits, a flood of huge "
                    "message arrays, two API keys' prompt caches against `macfleet serve`",
            "wall_s": round(time.monotonic() - t0, 1), **out}
