"""The prefill role: compute long prompts' KV for verifier agents and ship it once (flow KV).

A `PrefillRequest`'s ids are prefilled chunk by chunk on one compute thread; each chunk's K/V
of every layer streams back in bounded `KVChunk`s (overlapping the next chunk's compute), then
a `PrefillDone` with the count the verifier checks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from agents.specs import check_tokens
from bridge.errors import BAD_REQUEST, BUSY, INTERNAL, ProtocolError
from bridge.messages import ErrorReply, KVChunk, PrefillDone, PrefillRequest
from bridge.transport import Reply
from macfleet.engine.kvship import (DEFAULT_MAX_SLICE_BYTES, KV_CODECS, export_slices)
from macfleet.engine.models import LoadedModel
from macfleet.engine.text import MAX_PROMPT_TOKENS
from macfleet.engine.verifier import DEFAULT_PREFILL_STEP, make_trimmable_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillLimits:
    max_queued: int = 2  # each holds a whole prompt's KV while it is computed and sent
    max_prompt: int = MAX_PROMPT_TOKENS
    chunk_tokens: int = DEFAULT_PREFILL_STEP  # the verifier's own chunk: the same KV bits
    max_slice_bytes: int = DEFAULT_MAX_SLICE_BYTES


class PrefillService:
    def __init__(self, lm: LoadedModel, limits: PrefillLimits = PrefillLimits()) -> None:
        self.lm = lm
        self.limits = limits
        self._jobs: queue.Queue = queue.Queue(maxsize=limits.max_queued)
        self.active = 0
        self._thread = threading.Thread(target=self._run, name="prefill-compute", daemon=True)
        self._thread.start()

    @property
    def sessions(self) -> int:
        return self.active + self._jobs.qsize()

    def handle(self, msg, reply: Reply) -> bool:
        if not isinstance(msg, PrefillRequest):
            return False
        if msg.model != self.lm.spec:  # what it may ask (ProtocolError bad_request)
            raise ProtocolError(BAD_REQUEST, f"this prefill agent serves {self.lm.spec}, "
                                             f"not '{msg.model[:80]}'")
        if msg.codec not in KV_CODECS:
            raise ProtocolError(BAD_REQUEST, f"KV codec must be one of {', '.join(KV_CODECS)}")
        if not 1 <= len(msg.prompt) <= self.limits.max_prompt:
            raise ProtocolError(BAD_REQUEST, f"prompt must be 1..{self.limits.max_prompt} "
                                             "token ids")
        check_tokens(msg.prompt, self.lm.vocab_size, "prompt")
        try:
            self._jobs.put_nowait((msg, reply))
        except queue.Full:
            raise ProtocolError(BUSY, f"{self.limits.max_queued} prefills queued") from None
        return True

    def close(self, timeout: float = 5.0) -> None:
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            msg, reply = job
            self.active += 1
            try:
                self._prefill(msg, reply)
            except Exception as e:  # the daemon never dies of a request; the verifier gets why
                log.exception("prefill failed")
                reply(ErrorReply(INTERNAL, f"prefill: {type(e).__name__}: {e}"))
            finally:
                self.active -= 1

    def _prefill(self, msg: PrefillRequest, reply: Reply) -> None:
        """Chunk by chunk: compute, then send that chunk's K/V of every layer."""
        cache = make_trimmable_cache(self.lm.model)
        ids, step = msg.prompt, self.limits.chunk_tokens
        chunks = kv_bytes = 0
        compute_s = 0.0
        for start in range(0, len(ids), step):
            t0 = time.perf_counter()
            x = mx.array(ids[start:start + step], dtype=mx.uint32)[None]
            self.lm.model(x, cache=cache)
            mx.eval([c.state for c in cache])
            compute_s += time.perf_counter() - t0
            end = int(cache[0].offset)
            for s in export_slices(cache, start, end, msg.codec, self.limits.max_slice_bytes):
                reply(KVChunk(msg.session_id, s.layer, s.start, s.keys, s.values,
                              s.keys_scale, s.values_scale))
                chunks += 1
                kv_bytes += s.nbytes
        reply(PrefillDone(msg.session_id, len(ids), chunks, kv_bytes, compute_s * 1e3))
