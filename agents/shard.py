"""A verifier sharded over several processes (several Macs) with mlx.distributed, ring backend:
tensor, pipeline or expert (agents/expert.py) parallelism, rank 0 a drop-in `Verifier` whose
calls are broadcast to the followers, every collective under a `Watchdog` (docs/agents.md,
"shard.py").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from agents.expert import ExpertParallelMoE, expert_range, shard_experts
from agents.shard_traffic import ShardTraffic, pipeline_bytes, tensor_bytes
from agents.verifier_service import VerifierLost
from macfleet.engine.layers import head_logits, run_layers

from macfleet.engine.verifier import DEFAULT_PREFILL_STEP, Verifier
from macfleet.stats import ShardStats
from macfleet.topology.moe import ring_rounds

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 3.0  # any collective while generating
DEFAULT_START_DEADLINE_S = 120.0  # ring connect + first barrier (ranks load the model first)
EXIT_PEER_LOST = 75
MAX_BLOCK = DEFAULT_PREFILL_STEP
CMD_STOP, CMD_FORWARD, CMD_PREFILL, CMD_ROLLBACK, CMD_RESET, CMD_PING = range(6)
HEADER = 3  # cmd, n, unused
SHARD_MODES = ("tensor", "pipeline", "expert")


class ShardPeerLost(VerifierLost):
    """A collective failed or passed its deadline: a shard is dead or a link is cut."""


class Watchdog:
    """Arms a deadline around a blocking call; a thread fires `on_expire(what)` when it passes."""

    def __init__(self, deadline_s: float, on_expire: Callable[[str], None]) -> None:
        self.deadline_s = deadline_s
        self._on_expire = on_expire
        self._armed: tuple[float, str] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):  # a passed deadline fires within 20 ms
            with self._lock:
                armed = self._armed
            if armed and time.monotonic() > armed[0]:
                self._on_expire(armed[1])
                with self._lock:
                    self._armed = None

    @contextmanager
    def guard(self, what: str, deadline_s: float | None = None) -> Iterator[None]:
        with self._lock:
            self._armed = (time.monotonic() + (deadline_s or self.deadline_s), what)
        try:
            yield
        except RuntimeError as e:  # MLX's ring raises RuntimeError when a peer closes
            raise ShardPeerLost(f"{what} failed: {e} (a shard died?)") from e
        finally:
            with self._lock:
                self._armed = None

    def close(self) -> None:
        self._stop.set()


def init_ring(hostfile: str, rank: int) -> mx.distributed.Group:
    """Start this rank's ring group from a hostfile path (no ssh, no launcher)."""
    os.environ["MLX_HOSTFILE"] = hostfile
    os.environ["MLX_RANK"] = str(rank)
    return mx.distributed.init(strict=True, backend="ring")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n ports free on `host` now (all bound at once, so they differ), for a local ring."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class _Stage:
    """This rank's part of the model and its KV cache."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group, mode: str) -> None:
        self.model, self.group, self.mode = model, group, mode
        self.rank, self.size = group.rank(), group.size()
        args = model.args
        self.load = None  # expert mode: the router's load and the expert collective
        if mode == "expert":
            self.load = shard_experts(model, group)
            self.layers = list(model.model.layers)
        elif mode == "tensor":
            if args.num_attention_heads % self.size or args.num_key_value_heads % self.size:
                raise ValueError(f"tensor parallel needs heads ({args.num_attention_heads}) and "
                                 f"kv heads ({args.num_key_value_heads}) divisible by "
                                 f"{self.size}; use pipeline")
            model.shard(group)
            self.layers = list(model.model.layers)
        elif mode == "pipeline":
            # the contiguous split of expert mode's experts, of layers here
            a, b = expert_range(len(model.model.layers), self.size, self.rank)
            self.layers = list(model.model.layers)[a:b]
            model.model.layers = self.layers  # drop the other ranks' layers: this is the fit
        else:
            raise ValueError(f"unknown shard mode '{mode}': one of {SHARD_MODES}")
        self.moe_layers = sum(isinstance(getattr(ly, "mlp", None), ExpertParallelMoE)
                              for ly in self.layers)
        self.reset()

    def reset(self) -> None:
        self.cache = [KVCache() for _ in self.layers]
        if self.load is not None:
            self.load.reset()

    def flow_bytes(self, tokens: int, want_logits: bool) -> int:
        """Payload of one forward's collectives (expert mode: counted by its blocks)."""
        a = self.model.args
        if self.mode == "tensor":
            item = self.model.model.embed_tokens.weight.dtype.size
            return tensor_bytes(len(self.layers), tokens, a.hidden_size, item)
        if self.mode == "pipeline":
            return pipeline_bytes(self.size, tokens, a.hidden_size, a.vocab_size, want_logits)
        return 0

    def ring_rounds(self, want_logits: bool) -> float:
        """One forward's collectives, in small ring all-reduces (`topology.moe.ring_rounds`)."""
        return ring_rounds(self.mode, self.size, len(self.layers), self.moe_layers, want_logits)

    @property
    def offset(self) -> int:
        return int(self.cache[0].offset)

    def rollback(self, n: int) -> None:
        for c in self.cache:
            c.trim(n)

    def forward(self, ids: mx.array, want_logits: bool) -> mx.array | None:
        """ids: [1, L]. Returns logits [L, V] float32 on rank 0 (None elsewhere)."""
        L = ids.shape[1]
        if self.mode in ("tensor", "expert"):
            out = self.model(ids, cache=self.cache)[0].astype(mx.float32)
            mx.eval(out)
            if self.load is not None:
                self.load.flush()  # the router's choices, evaluated with the forward
            return out if self.rank == 0 else None
        H = self.model.args.hidden_size
        last = self.size - 1
        h = (self.model.model.embed_tokens(ids) if self.rank == 0 else
             mx.distributed.recv((1, L, H), mx.float32, self.rank - 1, group=self.group))
        h = run_layers(self.layers, h, self.cache)
        if self.rank < last:
            mx.eval(mx.distributed.send(h.astype(mx.float32), self.rank + 1, group=self.group))
        else:
            mx.eval(h)
        if not want_logits:
            return None
        V = self.model.args.vocab_size
        if self.rank == last:
            logits = head_logits(self.model, h)[0].astype(mx.float32)
            mx.eval(mx.distributed.send(logits, 0, group=self.group))
            return None
        if self.rank == 0:
            logits = mx.distributed.recv((L, V), mx.float32, last, group=self.group)
            mx.eval(logits)
            return logits
        return None


class ShardGroup:
    """Leader and followers share this: the command broadcast and the watched collectives."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group, mode: str,
                 watchdog: Watchdog) -> None:
        self.group, self.watchdog = group, watchdog
        self.stage = _Stage(model, group, mode)
        self.model = model  # `model.args` is what the spec-decode loop reads
        self.traffic = ShardTraffic(mode, group.size(), (HEADER + MAX_BLOCK) * 4)

    def barrier(self, deadline_s: float | None = None) -> None:
        with self.watchdog.guard("barrier", deadline_s):
            mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=self.group))

    def _exchange(self, cmd: int = 0, n: int = 0, tokens: Sequence[int] = ()) -> np.ndarray:
        buf = np.zeros(HEADER + MAX_BLOCK, dtype=np.int32)
        if self.group.rank() == 0:
            buf[0], buf[1] = cmd, n
            buf[HEADER:HEADER + len(tokens)] = tokens
        t0 = time.perf_counter()
        with self.watchdog.guard(f"command broadcast (cmd {cmd})"):
            out = mx.distributed.all_sum(mx.array(buf), group=self.group)
            mx.eval(out)
        # rank 0 arrives last (the followers wait in it): its time is the ring's latency
        self.traffic.command((time.perf_counter() - t0) * 1e3 if self.group.rank() == 0
                             else None)
        return np.array(out)

    def _run(self, cmd: int, n: int, tokens: np.ndarray) -> mx.array | None:
        st = self.stage
        if cmd in (CMD_FORWARD, CMD_PREFILL):
            ids = mx.array(tokens[:n].astype(np.uint32))[None]
            want = cmd == CMD_FORWARD
            t0 = time.perf_counter()
            with self.watchdog.guard(f"{st.mode} forward of {n} tokens"):
                out = st.forward(ids, want_logits=want)
            self.traffic.forward(n, st.flow_bytes(n, want), (time.perf_counter() - t0) * 1e3,
                                 st.ring_rounds(want))
            return out
        if cmd == CMD_ROLLBACK:
            st.rollback(n)
        elif cmd == CMD_RESET:
            st.reset()
            self.traffic.reset()
        return None

    def shard_stats(self) -> ShardStats:
        """This rank's tally since the last reset (rank 0's is the generation's shard flow)."""
        load = self.stage.load
        if load is None:
            return self.traffic.stats()
        per = tuple(int(c) for c in load.per_expert)
        n = self.group.size()
        ranks = tuple(sum(per[a:b]) for a, b in (expert_range(len(per), n, r)
                                                  for r in range(n)))
        return self.traffic.stats(collective_bytes=load.collective_bytes,
                                  collective_ms=load.collective_ms, expert_load=per,
                                  rank_load=ranks)

    def serve(self) -> None:
        """Follower loop: run what rank 0 broadcasts until CMD_STOP."""
        while True:
            buf = self._exchange()
            cmd, n = int(buf[0]), int(buf[1])
            if cmd == CMD_STOP:
                return
            self._run(cmd, n, buf[HEADER:])

    def command(self, cmd: int, n: int = 0, tokens: Sequence[int] = ()) -> mx.array | None:
        buf = self._exchange(cmd, n, tokens)
        return self._run(cmd, n, buf[HEADER:])


def start_group(model: nn.Module, hostfile: str, rank: int, mode: str,
                on_expire: Callable[[str], None], deadline_s: float) -> ShardGroup:
    """This rank's group: the ring connected and a first barrier passed within
    DEFAULT_START_DEADLINE_S (the ranks load the model first), then every collective watched
    with `deadline_s`; `on_expire(what)` when one passes its deadline."""
    wd = Watchdog(DEFAULT_START_DEADLINE_S, on_expire)
    with wd.guard("ring connect"):
        group = init_ring(hostfile, rank)
    shards = ShardGroup(model, group, mode, wd)
    shards.barrier()
    wd.deadline_s = deadline_s
    return shards


class ShardedVerifier(Verifier):
    """Rank 0's face: the `Verifier` interface over the whole group."""

    needs_keepalive = True  # the followers' watchdogs fire when rank 0 is silent

    def __init__(self, shards: ShardGroup, prefill_step: int = MAX_BLOCK) -> None:
        if shards.group.rank() != 0:
            raise ValueError("only rank 0 leads the sharded verifier")
        self.shards = shards
        self.model = shards.model
        self.prefill_step = min(prefill_step, MAX_BLOCK)

    @property
    def offset(self) -> int:
        return self.shards.stage.offset

    def reset(self) -> None:
        self.shards.command(CMD_RESET)

    def prefill(self, tokens: Sequence[int]) -> None:
        for i in range(0, len(tokens), self.prefill_step):
            chunk = list(tokens[i:i + self.prefill_step])
            self.shards.command(CMD_PREFILL, len(chunk), chunk)

    def forward(self, tokens: Sequence[int]) -> mx.array:
        if not 0 < len(tokens) <= MAX_BLOCK:
            raise ValueError(f"a block must have 1..{MAX_BLOCK} tokens, got {len(tokens)}")
        return self.shards.command(CMD_FORWARD, len(tokens), list(tokens))

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot roll back {n} of {self.offset} cached tokens")
        if n:
            self.shards.command(CMD_ROLLBACK, n)

    def shard_stats(self) -> ShardStats:
        """The shard flow and router load since the last `reset` (one generation)."""
        return self.shards.shard_stats()

    def keepalive(self) -> None:
        """Call at least every deadline while idle, or the followers' watchdogs fire."""
        self.shards.command(CMD_PING)

    def stop(self) -> None:
        self.shards.command(CMD_STOP)

