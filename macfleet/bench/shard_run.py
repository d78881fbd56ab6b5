"""`python -m macfleet.bench.shard_run`: one rank of a sharded verifier (agents/shard.py) as a
plain process, given a ring hostfile (no agents, no Zeroconf), for the shard tests and `macfleet
bench moe`. Rank 0 decodes greedily, then speculatively (serve/one.py `decode_ids`), and writes
ids, times and shard flow. Also the hostfile and the environment such a rank is started with.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from agents.shard import (DEFAULT_DEADLINE_S, EXIT_PEER_LOST, SHARD_MODES, ShardedVerifier,
                          ShardPeerLost, start_group)
from macfleet.stats import ShardStats

PING_REPEATS = 30
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def exit_on_expire(rank: int) -> Callable[[str], None]:
    def fire(what: str) -> None:
        sys.stderr.write(f"macfleet shard rank {rank}: ShardPeerLost: {what} did not complete "
                         f"within the deadline: a peer is dead or a link is cut; exiting\n")
        sys.stderr.flush()
        os._exit(EXIT_PEER_LOST)
    return fire


def write_hostfile(path: str, ports: Sequence[int], host: str = "127.0.0.1") -> str:
    with open(path, "w") as f:
        json.dump([[f"{host}:{p}"] for p in ports], f)
    return path


def rank_env(root: str) -> dict[str, str]:
    """The environment of a rank process started from a checkout at `root`: the project on the
    path, one BLAS thread (ranks share the machine's cores), OpenBLAS preloaded where present."""
    env = dict(os.environ, PYTHONPATH=str(root), OPENBLAS_NUM_THREADS="1")
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def _greedy_plain(v: ShardedVerifier, prompt: list[int], n: int
                  ) -> tuple[list[int], np.ndarray, ShardStats]:
    """Plain greedy decoding, one token per forward; returns ids, each step's logits and the
    shard flow of the prefill alone."""
    v.reset()
    v.prefill(prompt[:-1])
    prefilled = v.shard_stats()
    last, ids, rows = prompt[-1], [], []
    for _ in range(n):
        logits = v.forward([last])
        rows.append(np.array(logits[-1]))
        last = int(np.argmax(rows[-1]))
        ids.append(last)
        print(f"step {len(ids)}", file=sys.stderr, flush=True)
    return ids, np.stack(rows), prefilled


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of a sharded verifier (mlx.distributed ring)")
    p.add_argument("--hostfile", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--mode", choices=SHARD_MODES, required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-ids", default="", help="rank 0: JSON list of prompt token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--proposer", default="ngram", help="rank 0: proposer for the spec-decode run "
                   "(none to skip it)")
    p.add_argument("--out", default="", help="rank 0: write ids (+ logits .npy) here")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S)
    p.add_argument("--repeats", type=int, default=1, help="rank 0: plain decoding runs (the "
                   "median wall time is reported)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from macfleet.engine.models import load_model

    lm = load_model(args.model, cached=False)
    shards = start_group(lm.model, args.hostfile, args.rank, args.mode,
                         exit_on_expire(args.rank), args.deadline)
    group = shards.group
    print(f"rank {group.rank()}/{group.size()} ready ({args.mode})", file=sys.stderr, flush=True)
    try:
        if group.rank() != 0:
            shards.serve()
            return 0
        v = ShardedVerifier(shards)
        prompt = json.loads(args.prompt_ids)
        pings = []
        for _ in range(PING_REPEATS):  # the ring's all_sum latency, as this run sees it
            t0 = time.perf_counter()
            v.keepalive()
            pings.append((time.perf_counter() - t0) * 1e3)
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ids, logits, prefilled = _greedy_plain(v, prompt, args.max_tokens)
            walls.append(time.perf_counter() - t0)
        out = {"rank_size": group.size(), "mode": args.mode, "plain_ids": ids,
               "plain_s": float(np.median(walls)), "plain_s_all": walls,
               "plain_shard": v.shard_stats().to_dict(),
               "prefill_shard": prefilled.to_dict(),
               "ping_ms": float(np.median(pings))}
        if args.proposer != "none":
            from macfleet.engine.events import Finished
            from macfleet.engine.proposers import make_proposer
            from macfleet.serve.one import decode_ids

            prop = make_proposer(args.proposer, lm)
            t0 = time.perf_counter()
            # a fixed length: an adaptive one may back off to plain steps on a slow ring
            fin = [e for e in decode_ids(lm, prompt, prop, draft_tokens=4,
                                         max_tokens=args.max_tokens, eos_ids=frozenset(),
                                         verifier=v)
                   if isinstance(e, Finished)][0]
            out["spec_ids"] = list(fin.token_ids)
            out["spec_blocks"] = fin.stats.blocks
            out["spec_s"] = time.perf_counter() - t0
            out["spec_shard"] = v.shard_stats().to_dict()
        v.stop()
        if args.out:
            np.save(args.out + ".logits.npy", logits)
            with open(args.out, "w") as f:
                json.dump(out, f)
        return 0
    except ShardPeerLost as e:
        print(f"macfleet shard rank {group.rank()}: ShardPeerLost: {e}", file=sys.stderr)
        return EXIT_PEER_LOST
    finally:
        shards.watchdog.close()


if __name__ == "__main__":
    sys.exit(main())
