"""Heartbeat liveness: a pure table of hearts, and a thin thread that pings on a period.

Zeroconf cannot say an agent died: a SIGKILLed agent sends no goodbye and its records live in
every cache for their TTL (75 min for the service pointer). Liveness therefore comes from here.

The design follows jupyter_client / ipyparallel's HeartMonitor: every period each peer is pinged,
and at the next period hearts are sorted into new / good / failed. A failed heart starts a new
*generation*; pongs answering pings of an older generation are ignored, so a burst of stale
replies (e.g. queued in a socket while the peer was unreachable) cannot revive a peer: only an
answer to a ping sent after the failure does.

``HeartTable`` is pure (time is an argument, in ``time.monotonic_ns`` units) and is tested with a
fake clock. ``Heartbeat`` is the shell: a thread, an injected ``send_ping`` and callbacks. It
knows nothing of ZeroMQ; whoever owns the socket feeds replies to ``on_pong``.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 1.0  # how often each peer is pinged
DEFAULT_DEADLINE_S = 3.0  # silence that fails a peer: several periods, so one lost ping is fine
DEFAULT_WINDOW = 64  # RTT samples kept per peer
DEFAULT_JOIN_TIMEOUT_S = 2.0  # how long stop() waits for the thread

Peer = Hashable
_NS_PER_S = 1_000_000_000
_NS_PER_MS = 1_000_000


class PeerState(enum.Enum):
    WAITING = "waiting"  # pinged, never answered yet, deadline not reached
    ALIVE = "alive"
    FAILED = "failed"


@dataclass(frozen=True)
class RttStats:
    """Round-trip times over the sliding window; NaN everywhere when ``n == 0``."""

    p50_ms: float
    p95_ms: float
    last_ms: float
    n: int


EMPTY_RTT = RttStats(math.nan, math.nan, math.nan, 0)


@dataclass(frozen=True)
class HeartReport:
    """One period's sorting of the hearts. Each peer is in exactly one of new, good, failed,
    down, waiting; ``recovered`` is the part of ``new`` that had failed before."""

    new: frozenset[Peer] = frozenset()  # answering now, were not at the previous tick
    good: frozenset[Peer] = frozenset()  # answering now and at the previous tick
    failed: frozenset[Peer] = frozenset()  # silent past the deadline, just now
    down: frozenset[Peer] = frozenset()  # failed earlier, still silent
    waiting: frozenset[Peer] = frozenset()  # never answered, still within the deadline
    recovered: frozenset[Peer] = frozenset()


@dataclass
class _Heart:
    gen_start_ns: int  # when the current generation began (added, or failed)
    generation: int = 0
    state: PeerState = PeerState.WAITING
    last_pong_ns: int | None = None  # last accepted pong in this generation
    outstanding: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq -> (sent, gen)
    rtts_ms: deque[float] = field(default_factory=deque)


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually measured, no interpolation."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class HeartTable:
    """Pure liveness bookkeeping for a set of peers; not thread-safe (the shell locks it)."""

    def __init__(self, deadline_s: float = DEFAULT_DEADLINE_S,
                 window: int = DEFAULT_WINDOW) -> None:
        if deadline_s <= 0 or window < 1:
            raise ValueError(f"deadline_s must be > 0 and window >= 1, got {deadline_s}, {window}")
        self._deadline_ns = int(deadline_s * _NS_PER_S)
        self._window = window
        self._hearts: dict[Peer, _Heart] = {}

    def add(self, peer: Peer, now: int) -> None:
        """Start watching ``peer``; its deadline runs from ``now``. Idempotent."""
        if peer not in self._hearts:
            self._hearts[peer] = _Heart(gen_start_ns=now, rtts_ms=deque(maxlen=self._window))

    def remove(self, peer: Peer) -> None:
        """Stop watching ``peer`` (it left the fleet cleanly); unknown peers are ignored."""
        self._hearts.pop(peer, None)

    def peers(self) -> list[Peer]:
        return list(self._hearts)

    def state(self, peer: Peer) -> PeerState:
        """Raises KeyError for a peer not watched."""
        return self._hearts[peer].state

    def generation(self, peer: Peer) -> int:
        return self._hearts[peer].generation

    def beat_sent(self, peer: Peer, seq: int, now: int) -> None:
        """Record that ping ``seq`` left for ``peer`` at ``now`` (adds the peer if new)."""
        self.add(peer, now)
        heart = self._hearts[peer]
        heart.outstanding[seq] = (now, heart.generation)

    def pong(self, peer: Peer, seq: int, sent_ns: int, now: int) -> bool:
        """Accept a reply to ping ``seq``; returns False (and changes nothing) when it is not one
        we are waiting for: unknown peer or seq, a duplicate, a forged ``sent_ns``, or a ping of
        an older generation."""
        heart = self._hearts.get(peer)
        if heart is None:
            return False
        entry = heart.outstanding.pop(seq, None)
        if entry is None:
            return False
        sent, generation = entry
        if sent != sent_ns:
            log.debug("pong from %r seq %d: sent_ns %d, we sent at %d", peer, seq, sent_ns, sent)
            return False
        if generation != heart.generation:
            log.debug("late pong from %r answers generation %d, now %d", peer, generation,
                      heart.generation)
            return False
        heart.last_pong_ns = now
        heart.rtts_ms.append((now - sent) / _NS_PER_MS)
        return True

    def tick(self, now: int) -> HeartReport:
        """Sort every heart at ``now``; failing a heart starts its next generation."""
        new: set[Peer] = set()
        good: set[Peer] = set()
        failed: set[Peer] = set()
        down: set[Peer] = set()
        waiting: set[Peer] = set()
        recovered: set[Peer] = set()
        for peer, heart in self._hearts.items():
            if heart.last_pong_ns is not None and now - heart.last_pong_ns <= self._deadline_ns:
                if heart.state is PeerState.ALIVE:
                    good.add(peer)
                else:
                    new.add(peer)
                    if heart.state is PeerState.FAILED:
                        recovered.add(peer)
                    heart.state = PeerState.ALIVE
            elif now - (heart.last_pong_ns or heart.gen_start_ns) > self._deadline_ns:
                if heart.state is PeerState.FAILED:
                    down.add(peer)
                else:
                    failed.add(peer)
                    heart.state = PeerState.FAILED
                    heart.generation += 1
                    heart.gen_start_ns = now
                    heart.last_pong_ns = None
            elif heart.state is PeerState.FAILED:
                down.add(peer)
            else:
                waiting.add(peer)
            # Pings older than the deadline can no longer prove anything: forget them.
            heart.outstanding = {
                seq: entry for seq, entry in heart.outstanding.items()
                if now - entry[0] <= self._deadline_ns
            }
        return HeartReport(
            new=frozenset(new), good=frozenset(good), failed=frozenset(failed),
            down=frozenset(down), waiting=frozenset(waiting), recovered=frozenset(recovered),
        )

    def rtt(self, peer: Peer) -> RttStats:
        """RTT over the last ``window`` accepted pongs; EMPTY_RTT for unknown or silent peers."""
        heart = self._hearts.get(peer)
        if heart is None or not heart.rtts_ms:
            return EMPTY_RTT
        ordered = sorted(heart.rtts_ms)
        return RttStats(
            p50_ms=_percentile(ordered, 0.50),
            p95_ms=_percentile(ordered, 0.95),
            last_ms=heart.rtts_ms[-1],
            n=len(ordered),
        )


SendPing = Callable[[Peer, int, int], None]
PeerCallback = Callable[[Peer], None]


class Heartbeat:
    """A thread that pings every peer each ``period_s`` and reports failures and recoveries.

    ``send_ping(peer, seq, sent_ns)`` is called from the heartbeat thread and must not block
    (send with NOBLOCK and drop on a full queue: a lost ping is what heartbeats are for). The
    peer echoes ``seq`` and ``sent_ns``; whoever receives the echo calls ``on_pong`` from any
    thread. ``on_failed`` / ``on_recovered`` / ``on_report`` run on the heartbeat thread, outside
    the lock, and should be quick. A peer silent for ``deadline_s`` is failed at the next period,
    i.e. within ``deadline_s + period_s`` of its last answer.
    """

    def __init__(
        self,
        send_ping: SendPing,
        *,
        peers: Iterable[Peer] = (),
        period_s: float = DEFAULT_PERIOD_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
        window: int = DEFAULT_WINDOW,
        on_failed: PeerCallback | None = None,
        on_recovered: PeerCallback | None = None,
        on_report: Callable[[HeartReport], None] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self._send_ping = send_ping
        self._period_s = period_s
        self._on_failed = on_failed
        self._on_recovered = on_recovered
        self._on_report = on_report
        self._clock = clock
        self._join_timeout_s = join_timeout_s
        self._table = HeartTable(deadline_s, window)
        self._lock = threading.Lock()
        self._seq = 0
        self._last_report = HeartReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = clock()
        for peer in peers:
            self._table.add(peer, now)

    # -- called from any thread ------------------------------------------------------------
    def add_peer(self, peer: Peer) -> None:
        with self._lock:
            self._table.add(peer, self._clock())

    def remove_peer(self, peer: Peer) -> None:
        with self._lock:
            self._table.remove(peer)

    def on_pong(self, peer: Peer, seq: int, sent_ns: int) -> bool:
        """Feed one echoed ping; returns whether it counted (see HeartTable.pong)."""
        with self._lock:
            return self._table.pong(peer, seq, sent_ns, self._clock())

    def peers(self) -> list[Peer]:
        with self._lock:
            return self._table.peers()

    def rtt(self, peer: Peer) -> RttStats:
        with self._lock:
            return self._table.rtt(peer)

    def state(self, peer: Peer) -> PeerState:
        with self._lock:
            return self._table.state(peer)

    @property
    def last_report(self) -> HeartReport:
        return self._last_report

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("heartbeat already started")
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop and join within ``timeout_s`` (default join_timeout_s); False if it did not end
        in time (a ``send_ping`` that blocks), which is logged."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(self._join_timeout_s if timeout_s is None else timeout_s)
        if thread.is_alive():
            log.warning("heartbeat thread did not stop within its deadline")
            return False
        return True

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            self._period()
            next_at += self._period_s
            delay = next_at - time.monotonic()
            if delay < 0:  # we fell behind (a slow callback): skip missed periods, no burst
                next_at = time.monotonic()
                delay = 0.0
            if self._stop.wait(delay):
                return

    def _period(self) -> None:
        """Sort the hearts on the pongs of the last period, then ping everyone again."""
        with self._lock:
            now = self._clock()
            report = self._table.tick(now)
            pings = []
            for peer in self._table.peers():
                self._seq += 1
                self._table.beat_sent(peer, self._seq, now)
                pings.append((peer, self._seq, now))
        self._last_report = report
        for peer in report.failed:
            log.info("peer %r failed (no pong within the deadline)", peer)
            self._call(self._on_failed, peer)
        for peer in report.recovered:
            log.info("peer %r recovered", peer)
            self._call(self._on_recovered, peer)
        if self._on_report is not None:
            self._call(self._on_report, report)
        for peer, seq, sent_ns in pings:
            self._call(self._send_ping, peer, seq, sent_ns)

    @staticmethod
    def _call(callback: Callable[..., None] | None, *args: object) -> None:
        """Run a user callback. This is the thread's boundary: a callback that raises must not
        end liveness for every peer, so it is logged and the period goes on (a ping that failed
        to leave just fails its peer at the deadline)."""
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - thread boundary, see docstring
            log.exception("heartbeat callback %r failed", callback)
