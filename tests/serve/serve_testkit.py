"""Helpers for the HTTP tests (imported by name; conftest.py holds the fixtures): a real
`macfleet serve` process on 127.0.0.1 (port chosen by the OS).

A subprocess rather than a thread: the server's engine thread and this process's own MLX use
would trip MLX's exit abort (ml-explore/mlx#3126), and a subprocess is what users run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 60.0
SMOLLM2_START_S = 300.0  # the embedded smollm2 loads in 15 to 50 s here, more on a loaded box
API_KEY = "test-key-123"
# a small Hermes/Qwen-style template with tools (tiny models and smollm2 have none)
TOOLS_TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
# SmolLM2's own template's system message (it adds it when a conversation has none): with it
# first, TOOLS_TEMPLATE renders a conversation without tools as the model's template does,
# token for token -- the shared smollm2 server answers as one on the model's own template
SMOLLM2_SYSTEM = {"role": "system",
                  "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}


@dataclass(frozen=True)
class Server:
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    model: str
    key: str | None
    banner: str = ""
    before: tuple[str, ...] = ()  # what it printed before the banner (where it serves, loading)

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=5).json()


def start_server(*extra: str, model: str = "tiny:1", key: str | None = API_KEY,
                 local: bool = True, timeout_s: float | None = None) -> Server:
    env = dict(os.environ)
    blas = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    if os.path.exists(blas):
        env.setdefault("LD_PRELOAD", blas)
    cmd = [sys.executable, "-m", "macfleet", "serve", *(["--local"] if local else []),
           "--model", model, "--port", "0", *extra]
    if key:
        cmd += ["--api-key", key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    deadline = time.monotonic() + (START_TIMEOUT_S if timeout_s is None else timeout_s)
    line = ""
    before: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if m:
            return Server(m.group(1), proc, model, key, line.strip(), tuple(before))
        before.append(line.strip())
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"macfleet serve did not start: {line!r} {proc.stdout.read()[-2000:]}")


def start_smollm2() -> Server:
    """`serve --local` of the embedded smollm2 with TOOLS_TEMPLATE and API_KEY: the ordinary
    smollm2 server (conftest.py's `smollm2_server`, one per test process)."""
    return start_server("--chat-template", str(TOOLS_TEMPLATE), model="smollm2",
                        timeout_s=SMOLLM2_START_S)


def stop_server(s: Server) -> None:
    s.proc.terminate()
    try:
        s.proc.wait(10)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        s.proc.wait(5)


def wait_idle(s: Server, timeout_s: float = 10.0) -> dict:
    """Health once no session is active (every session freed), or the last health seen."""
    deadline = time.monotonic() + timeout_s
    h = s.health()
    while time.monotonic() < deadline and (h["active_sessions"] or h["waiting_sessions"]):
        time.sleep(0.05)
        h = s.health()
    return h


# -- a tokenizer for grammar tests without a model ----------------------------------------
class AsciiTokenizer:
    """Printable ASCII and newline, a token each; end-of-sequence last."""

    chars = "\n" + "".join(chr(i) for i in range(32, 127))
    eos_token_ids = frozenset({len(chars)})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.chars.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids if i < len(self.chars))


ASCII = AsciiTokenizer()
VOCAB = len(ASCII.chars) + 1


# -- the real HTTP app in-process, an engine that answers from a script -------------------------
class CharTokenizer:
    """Characters as token ids (any text round-trips), with the test template's support."""

    has_chat_template = False
    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Answers every request with one text, a few tokens per block, as the engine emits them:
    what a model would send through the HTTP layer (tool calls: test_tools.py; a
    response_format's answer: test_structured.py). Records each request's text and grammar."""

    alive, iterations = True, 0
    refuse: str | None = None  # what its grammar check says of every grammar (None: fine)

    def __init__(self, answer: str, finish: str = "stop") -> None:
        self.answer, self.finish, self.prompts, self.grammars = answer, finish, [], []

    def load(self):
        return 0, 0

    def grammar_error(self, grammar):
        return self.refuse

    def submit(self, req, emit, on_close=None):
        from macfleet.engine.events import Finished, GenerationStats, TokensCommitted

        self.prompts.append(req.text)
        self.grammars.append(req.grammar)
        ids = [ord(c) for c in self.answer]
        for b, i in enumerate(range(0, len(ids), 3)):
            emit(TokensCommitted(b, tuple(ids[i:i + 3])))
        emit(Finished(GenerationStats(tokens=len(ids), finish_reason=self.finish), tuple(ids)))
        if on_close is not None:
            on_close()

        class Handle:
            sid = 0

            def cancel(self):
                pass
        return Handle()
