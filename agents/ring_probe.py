"""Measure a shard ring's two primitives, for the planner's shard cost: the latency of a small
all_sum (what tensor and expert parallelism pay per collective) and of one point-to-point hop
(send/recv, what pipeline parallelism pays per rank boundary).

`python -m agents.ring_probe --hostfile H --rank R [--out F]`: every rank runs the same sequence
(no leader protocol); rank 0 writes the medians. Every collective runs under the shard Watchdog.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

from agents.shard import DEFAULT_START_DEADLINE_S, Watchdog, exit_on_expire, init_ring

DEFAULT_REPEATS = 50
DEFAULT_WIDTH = 64  # one [1, hidden] float32 activation of the tiny models


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def probe(group: mx.distributed.Group, wd: Watchdog, repeats: int = DEFAULT_REPEATS,
          width: int = DEFAULT_WIDTH) -> dict[str, float]:
    """Medians in ms: `allreduce_ms` (all_sum of [1, width] float32), `hop_ms` (one send/recv
    of the same, measured as a round trip 0 -> 1 -> 0 halved)."""
    r, n = group.rank(), group.size()
    x = mx.ones((1, width), dtype=mx.float32)
    sums, hops = [], []
    for _ in range(repeats):
        with wd.guard("probe all_sum"):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            sums.append((time.perf_counter() - t0) * 1e3)
    for _ in range(repeats):
        with wd.guard("probe send/recv"):
            t0 = time.perf_counter()
            if r == 0:
                mx.eval(mx.distributed.send(x, 1, group=group))
                mx.eval(mx.distributed.recv_like(x, 1, group=group))
            elif r == 1:
                y = mx.distributed.recv_like(x, 0, group=group)
                mx.eval(y)
                mx.eval(mx.distributed.send(y, 0, group=group))
            hops.append((time.perf_counter() - t0) * 1e3 / 2)
        with wd.guard("probe barrier"):
            mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))
    return {"ranks": n, "allreduce_ms": _median(sums), "hop_ms": _median(hops)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="measure a shard ring's all_sum and hop latency")
    p.add_argument("--hostfile", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    wd = Watchdog(DEFAULT_START_DEADLINE_S, exit_on_expire(args.rank))
    with wd.guard("ring connect"):
        group = init_ring(args.hostfile, args.rank)
    wd.deadline_s = 10.0
    try:
        res = probe(group, wd, args.repeats)
    finally:
        wd.close()
    if group.rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
