"""The verifier's side of flow KV: `PrefillStage` decides (topology/disagg.py) whether a long
prompt's prefill runs on a prefill agent and fetches its KV meanwhile; a failed prefill agent
costs a local prefill, never the request (docs/agents.md, "remote_prefill.py").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import GenerateRequest, KVChunk, PrefillDone, PrefillRequest
from bridge.transport import Client
from macfleet.engine.kvship import (DEFAULT_KV_CODEC, KVAssembler, KVLayout, KVShipError,
                                    KVSlice)
from macfleet.engine.text import encode_prompt
from macfleet.stats import KVFlow
from macfleet.topology.disagg import (DEFAULT_MAX_TTFT_RATIO, DEFAULT_MIN_PROMPT_TOKENS,
                                      DEFAULT_MIN_SAVED_MS, DisaggInputs, decide)

log = logging.getLogger(__name__)

DEFAULT_CONNECT_S = 0.5
DEFAULT_MIN_SILENCE_S = 3.0  # a prefill agent silent this long (or 3 chunks' time) is dead
# before any speed is measured here (a hung agent's bounds: docs/agents.md, "remote_prefill.py")
DEFAULT_UNMEASURED_SILENCE_S = 60.0
DEFAULT_MIN_DEADLINE_S = 120.0
DEFAULT_UNMEASURED_DEADLINE_S = 900.0  # the whole fetch
ATTENTION_TOKENS = 1500.0  # context at which a chunk's attention costs what its weights do
DEFAULT_ASSUMED_TOK_S = 1000.0  # prefill speed until this verifier has measured its own
_EWMA = 0.5
MIN_PROMPT_CHARS = 256  # shorter prompts skip the stage (no tokenizing off the compute thread)


class PrefillFailed(RuntimeError):
    """The prefill agent did not deliver a complete KV in time (the message says why)."""


@dataclass(frozen=True)
class DisaggPolicy:
    """When this verifier ships prefills out (the planner's knobs) and how KV travels."""

    codec: str = DEFAULT_KV_CODEC
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    min_saved_ms: float = DEFAULT_MIN_SAVED_MS
    max_ttft_ratio: float = DEFAULT_MAX_TTFT_RATIO


@dataclass(frozen=True)
class Staged:
    """What the stage hands the compute thread: the prompt ids, and a shipped KV when there is
    one (kv: per layer (keys, values) float32 [heads, tokens, head_dim])."""

    ids: list[int]
    flow: KVFlow
    kv: list | None = None


class Meter:
    """What this verifier measured, for the planner: prefill speeds and the link (EWMA)."""

    def __init__(self) -> None:
        self.local_tok_s = 0.0
        self.remote_tok_s = 0.0
        self.link_bytes_s = 0.0

    @staticmethod
    def _mix(old: float, new: float) -> float:
        return new if old <= 0 else (1 - _EWMA) * old + _EWMA * new

    def local(self, tokens: int, ms: float) -> None:
        if tokens >= 64 and ms > 0:
            self.local_tok_s = self._mix(self.local_tok_s, 1e3 * tokens / ms)

    def remote(self, flow: KVFlow) -> None:
        if flow.tokens >= 64 and flow.prefill_ms > 0:
            self.remote_tok_s = self._mix(self.remote_tok_s, 1e3 * flow.tokens / flow.prefill_ms)
        wire_ms = flow.kv_ms - flow.prefill_ms  # what the overlap left on the wire, at least
        if flow.kv_bytes and wire_ms > 0:
            self.link_bytes_s = self._mix(self.link_bytes_s, 1e3 * flow.kv_bytes / wire_ms)

    def inputs(self, prompt_tokens: int, agents: int, layout: KVLayout, policy: DisaggPolicy
               ) -> DisaggInputs:
        local = self.local_tok_s or DEFAULT_ASSUMED_TOK_S
        extra = {"link_bytes_per_s": self.link_bytes_s} if self.link_bytes_s else {}
        return DisaggInputs(prompt_tokens=prompt_tokens, prefill_agents=agents,
                            kv_bytes_per_token=layout.bytes_per_token(policy.codec),
                            local_prefill_tok_s=local,
                            remote_prefill_tok_s=self.remote_tok_s or local,
                            min_prompt_tokens=policy.min_prompt_tokens,
                            min_saved_ms=policy.min_saved_ms,
                            max_ttft_ratio=policy.max_ttft_ratio, **extra)


def attention_factor(tokens: int) -> float:
    """How much slower than a short prompt's a chunk at `tokens` of context computes."""
    return 1.0 + tokens / ATTENTION_TOKENS


def silence_s(chunk_tokens: int, tok_s: float, prompt_tokens: int = 0) -> float:
    """How long a prefill agent may say nothing: 3 chunks' compute at the measured speed (the
    prompt's last chunk's), at least 3 s; DEFAULT_UNMEASURED_SILENCE_S while tok_s is 0."""
    if tok_s <= 0:
        return DEFAULT_UNMEASURED_SILENCE_S
    return max(DEFAULT_MIN_SILENCE_S,
               3.0 * chunk_tokens / tok_s * attention_factor(prompt_tokens))


def fetch_kv(endpoint: str, key: bytes | None, *, ids: Sequence[int], model: str,
             layout: KVLayout, codec: str, silence: float, deadline_s: float
             ) -> tuple[list, KVFlow]:
    """The KV of `ids` from the prefill agent at `endpoint`: (per-layer arrays, its KVFlow);
    PrefillFailed when it errs, dies, is silent or late, or sends a KV that does not fit."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + deadline_s
    asm = KVAssembler(layout, len(ids))
    chunks = 0
    req = PrefillRequest(uuid.uuid4().hex[:16], model, [int(t) for t in ids], codec)
    try:
        with Client(endpoint, key=key, watch_peer=True, connect_timeout_s=DEFAULT_CONNECT_S) as c:
            for msg in c.stream(req, timeout_per_msg=silence):
                if time.monotonic() > deadline:
                    raise PrefillFailed(f"no complete KV within {deadline_s:.1f} s")
                if isinstance(msg, KVChunk):
                    asm.add(KVSlice(msg.layer, msg.start, msg.keys, msg.values,
                                    msg.keys_scale, msg.values_scale))
                    chunks += 1
                elif isinstance(msg, PrefillDone):
                    if msg.chunks != chunks or not asm.complete:
                        raise PrefillFailed(f"{chunks} of {msg.chunks} KV chunks arrived")
                    kv_ms = (time.perf_counter() - t0) * 1e3
                    return asm.arrays(), KVFlow(
                        where="remote", agent=endpoint, tokens=len(ids), codec=codec,
                        kv_bytes=asm.nbytes, kv_ms=kv_ms, prefill_ms=msg.prefill_ms)
    except (ProtocolError, TransportTimeout, PeerUnavailable, KVShipError) as e:
        raise PrefillFailed(f"{type(e).__name__}: {e}") from None
    raise PrefillFailed("the prefill agent's stream ended without PrefillDone")


class PrefillStage:
    """One thread between a verifier's door and its compute queue: endpoints() lists live
    prefill agents, best first; submit(msg, reply, staged) queues a job (may block while full)."""

    def __init__(self, lm, *, key: bytes | None, layout: KVLayout,
                 endpoints: Callable[[], list[str]],
                 submit: Callable[[GenerateRequest, Callable, Staged | None], None],
                 policy: DisaggPolicy = DisaggPolicy(), max_queued: int = 8) -> None:
        self.lm, self.key, self.layout = lm, key, layout
        self.endpoints, self.submit, self.policy = endpoints, submit, policy
        self.meter = Meter()
        self._q: queue.Queue = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._run, name="prefill-stage", daemon=True)
        self._thread.start()

    def wants(self, msg: GenerateRequest) -> bool:
        """Whether a request may be long enough for the stage (no tokenizer); not with a
        hidden-state drafter, which needs the prompt's hidden states a shipped KV does not carry."""
        return (len(msg.prompt) >= MIN_PROMPT_CHARS and "eagle" not in msg.proposer_spec
                and bool(self.endpoints()))

    def put(self, msg: GenerateRequest, reply: Callable) -> None:
        self._q.put_nowait((msg, reply))  # queue.Full: the caller says busy

    def close(self) -> None:
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass

    def _run(self) -> None:
        """Decide here (quick); a fetch gets its own thread, so no short prompt waits behind a
        long one's transfer."""
        while True:
            job = self._q.get()
            if job is None:
                return
            msg, reply = job
            try:
                staged, fetch = self.plan(msg)
            except Exception as e:  # noqa: BLE001 - the compute thread reports the request's error
                log.info("prefill stage: %s; the verifier runs the request as it is", e)
                staged, fetch = None, None
            if fetch is None:
                self.submit(msg, reply, staged)
                continue
            threading.Thread(target=self._fetch_then_submit, args=(msg, reply, staged, fetch),
                             name="prefill-fetch", daemon=True).start()

    def _fetch_then_submit(self, msg, reply, local: Staged, fetch: Callable[[], Staged]) -> None:
        try:
            staged = fetch()
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the request still runs
            log.exception("prefill fetch failed")
            staged = replace(local, flow=KVFlow(where="fallback", reason=f"fetch failed: {e}"[:300]))
        self.submit(msg, reply, staged)

    def plan(self, msg: GenerateRequest) -> tuple[Staged, Callable[[], Staged] | None]:
        """The ids and the planner's choice; for a remote prefill, the fetch to run."""
        ids = encode_prompt(self.lm.tokenizer, msg.prompt, msg.chat) + list(msg.prefix_ids)
        eps = self.endpoints()
        d = decide(self.meter.inputs(len(ids), len(eps), self.layout, self.policy))
        if not self.meter.local_tok_s:
            d = replace(d, reason=d.reason + " (prefill speed assumed "
                        f"{DEFAULT_ASSUMED_TOK_S:.0f} tok/s until measured here)")
        local = Staged(ids, KVFlow(where="local", reason=d.reason))
        if not d.remote:
            return local, None
        return local, lambda: self.fetch(ids, eps[0], d)

    def fetch(self, ids: list[int], endpoint: str, d) -> Staged:
        tok_s = self.meter.remote_tok_s or self.meter.local_tok_s  # 0: not measured yet
        # the planner's times are linear in the prompt; attention makes a long one's mean chunk
        # slower by about half the last one's factor
        deadline = (max(DEFAULT_MIN_DEADLINE_S, 3.0 * max(d.remote_ms, d.local_ms) / 1e3
                        * attention_factor(len(ids) // 2)) if tok_s
                    else DEFAULT_UNMEASURED_DEADLINE_S)
        try:
            kv, flow = fetch_kv(endpoint, self.key, ids=ids[:-1], model=self.lm.spec,
                                layout=self.layout, codec=self.policy.codec,
                                silence=silence_s(512, tok_s, len(ids)), deadline_s=deadline)
        except PrefillFailed as e:
            log.warning("prefill agent %s failed (%s): prefilling locally", endpoint, e)
            return Staged(ids, KVFlow(where="fallback", agent=endpoint,
                                      reason=f"prefill agent failed: {e}"[:300]))
        self.meter.remote(flow)
        return Staged(ids, replace(flow, reason=d.reason), kv)
