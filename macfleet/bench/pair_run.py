"""The shell of `bench pair` (bench/pair.py says what the figures mean).

One Mac = one core: the one-process runs happen in a child process pinned to core 0 (mlx-lm and
macfleet alike, the same loaded models); the two-agent runs start a verifier agent on core 0 and
a draft-model agent (`agent --role proposer --draft MODEL`) on core 1 as real processes found
over Zeroconf (macfleet/fleet/local.py), and the client asks through the wire like `generate`.
Every rate is a stream rate: tokens after the first commit / time from the first commit to the
last, so prefill is left out the same way for every run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from macfleet.bench.pair_model import DRAFT_SPEC

VERIFY_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
_WORKER_TIMEOUT_S = 3600


def _stream_rate(times: Sequence[tuple[float, int]]) -> float:
    """(time, tokens) per commit -> tokens after the first commit per second."""
    if len(times) < 2:
        return 0.0
    (t0, _), (t1, _) = times[0], times[-1]
    n = sum(c for _, c in times[1:])
    return n / (t1 - t0) if t1 > t0 else 0.0


# --- the one-process runs (in a child pinned to one core) -------------------------------------


def _measure_costs(model, draft, context: int = 96, reps: int = 5) -> dict:
    """verify(L) of the verifier and one token of the draft model (engine/verify_costs.py's
    probe: fastest of reps, after `context` cached tokens: a short chat's answer)."""
    from macfleet.engine.verify_costs import probe_verify_costs

    return {"verify_ms": probe_verify_costs(model, VERIFY_LENGTHS, context, reps),
            "draft_ms": probe_verify_costs(draft, (1,), context, reps)[1]}


def _mlx_run(gen, eos: frozenset[int]) -> tuple[list[int], float]:
    """An mlx-lm generator's ids and rate, timed by commit as macfleet's runs are: its
    speculative step yields a block's tokens one by one at once, the verifier's own token
    (`from_draft` False) last, so a commit ends there (plain decoding: every token). Timing
    each token instead would count the rest of the first block, drafted and verified before
    the clock starts, as free tokens (~7% on a 57-token answer at k = 4)."""
    ids, times, pending = [], [], 0
    for tok, _, *from_draft in gen:
        t = int(tok)
        ids.append(t)
        pending += 1
        if not (from_draft and from_draft[0]) or t in eos:
            times.append((time.perf_counter(), pending))
            pending = 0
        if t in eos:
            break
    if pending:
        times.append((time.perf_counter(), pending))
    return ids, _stream_rate(times)


def _macfleet_run(events) -> tuple[list[int], float, dict]:
    from macfleet.engine.events import Finished

    times, fin = [], None
    for ev in events:
        toks = getattr(ev, "tokens", None)  # TextDelta (the driver's commits)
        if toks and not isinstance(ev, Finished):
            times.append((time.perf_counter(), len(toks)))
        elif isinstance(ev, Finished):
            fin = ev
    st = fin.stats
    return list(fin.token_ids), _stream_rate(times), {
        "drafted": st.drafted, "accepted": st.accepted, "blocks": st.blocks}


def one_process(verifier_dir: str, prompts: Sequence[str], tokens: int, k: int,
                plain: bool = True, draft_spec: str = DRAFT_SPEC) -> dict:
    """Plain and drafting-in-series runs of every prompt, macfleet and mlx-lm, this process
    (plain: also the plain runs; their speed depends on the verifier's shapes, not on the
    dial's weights, so one setting of a width measures them for all). `draft_spec`: the draft
    model (SmolLM2, or the draft dial's noisy SmolLM2 directory: the same shapes)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    from macfleet.engine.models import load_model
    from macfleet.engine.proposers import make_proposer
    from macfleet.engine.text import encode_prompt
    from macfleet.serve.one import decode_ids

    lm = load_model(verifier_dir)
    draft = load_model(draft_spec)
    # the weights are memory-mapped: the first forwards page them in from disk (seconds a
    # token for a few GB), which neither the cost probe nor the first prompt may pay
    for m in (lm.model, draft.model):
        _measure_costs(m, m, reps=0)
    costs = _measure_costs(lm.model, draft.model)
    greedy = make_sampler(0.0)
    eos = lm.eos_ids
    runs = []
    for text in prompts:
        ids = encode_prompt(lm.tokenizer, text, True)
        row = {"prompt": text}
        # mlx-lm first then macfleet, plain then drafting (each pair back to back)
        if plain:
            row["mlx_plain"] = _mlx_run(generate_step(mx.array(ids), lm.model,
                                                      max_tokens=tokens, sampler=greedy), eos)
            row["plain"] = _macfleet_run(decode_ids(lm, ids, draft_tokens=0,
                                                    max_tokens=tokens))
        row["mlx_spec"] = _mlx_run(speculative_generate_step(
            mx.array(ids), lm.model, draft.model, num_draft_tokens=k, max_tokens=tokens,
            sampler=greedy), eos)
        row["spec"] = _macfleet_run(decode_ids(
            lm, ids, make_proposer(f"draft:{draft_spec}", lm), draft_tokens=k,
            max_tokens=tokens))
        runs.append({name: (v if name == "prompt" else
                            {"ids": v[0], "tok_s": v[1], **(v[2] if len(v) > 2 else {})})
                     for name, v in row.items()})
    return {"costs": costs, "runs": runs, "eos": sorted(eos)}


def _pinned_child(job: dict) -> dict:
    """This module's `main` in a child pinned to `job["core"]` (one BLAS thread): its last
    stdout line, as JSON."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "macfleet.bench.pair_run", json.dumps(job)],
                         env=env, capture_output=True, text=True, timeout=_WORKER_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"pair worker ({job.get('mode', 'one')}) failed:\n"
                           f"{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_pinned(verifier_dir: str, prompts: Sequence[str], tokens: int, k: int,
               core: int = 0, plain: bool = True, draft_spec: str = DRAFT_SPEC) -> dict:
    """`one_process` in a child pinned to `core` (one BLAS thread)."""
    return _pinned_child({"dir": verifier_dir, "prompts": list(prompts), "tokens": tokens,
                          "k": k, "core": core, "plain": plain, "draft": draft_spec})


# --- the two-agent runs ------------------------------------------------------------------------


def at_once(ask: Callable[[str], dict], texts: Sequence[str]) -> tuple[float, list[dict]]:
    """Every text asked at once, a thread each: the wall time of the whole round and the
    answers in the order of `texts` (a request that raised raises here)."""
    import threading

    got: list[dict | BaseException | None] = [None] * len(texts)

    def one(i: int) -> None:
        try:
            got[i] = ask(texts[i])
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            got[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return wall, list(got)


def two_agents(verifier_dir: str, prompts: Sequence[str], tokens: int,
               progress: Callable[[str], None] = print, batch_sessions: int | None = None,
               alone: bool = True, draft_spec: str = DRAFT_SPEC, sessions: int = 1,
               rounds: int = 2, stall_ratio: float | None = None) -> dict:
    """The verifier agent on core 0, a draft-model agent on core 1: each prompt drafted ahead
    (spec `draft`) and (alone) by the verifier agent alone (`none`: its speed is the
    verifier's shapes', so one setting of a width measures it for all, as `one_process`'s
    plain runs). sessions > 1: then `rounds` rounds of that many requests at once (the
    prompts in turn), each round by the verifier agent alone and drafted ahead, alternating
    which goes first: every answer's tokens over the round's wall time (several users of
    one pair: the verifier's continuous batch, the draft agent's streams drafted together)."""
    from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
    from bridge.messages import GenerateChunk, GenerateDone
    from macfleet.fleet import local
    from macfleet.fleet.client import generate_remote
    from macfleet.fleet.keys import keygen

    with tempfile.TemporaryDirectory(prefix="macfleet-pair-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        extra = {"proposer": ["--draft", draft_spec]}
        extra["verifier"] = ([] if batch_sessions is None else
                             ["--batch-sessions", str(batch_sessions)]) + \
            ([] if stall_ratio is None else ["--stall-ratio", str(stall_ratio)])
        cards = local.up(2, model=verifier_dir, key=key, key_path=key_path,
                         run_dir=Path(tmp) / "run", pin=True, extra_args=extra,
                         timeout_s=600)
        try:
            ver = next(c for c in cards if ROLE_VERIFIER in c.roles)
            prop = next(c for c in cards if ROLE_PROPOSER in c.roles)

            def ask(text: str, spec: str) -> dict:
                times, done = [], None
                for m in generate_remote(ver, key, prompt=text, chat=True, max_tokens=tokens,
                                         proposers=[prop.router_endpoint] if spec != "none"
                                         else [], proposer_spec=spec, draft_tokens="auto"):
                    if isinstance(m, GenerateChunk) and m.token_ids:
                        times.append((time.perf_counter(), len(m.token_ids)))
                    elif isinstance(m, GenerateDone):
                        done = m
                st = done.stats
                fl = st.fleet.flows if st.fleet is not None else None
                return {"ids": list(done.token_ids), "tok_s": _stream_rate(times),
                        "drafted": st.drafted, "accepted": st.accepted, "blocks": st.blocks,
                        "lead": fl.ahead_lead if fl else 0.0,
                        "waste": fl.ahead_waste if fl else 0.0,
                        "wait_ms": fl.ahead_wait_ms if fl else 0.0,
                        "agent_token_ms": fl.ahead_token_ms if fl else 0.0,
                        "failures": st.fleet.proposer_failures if st.fleet else 0,
                        # where a block's time went, on the verifier: verifying, and waiting
                        # for drafts (the rest is the loop's own)
                        "verify_ms_per_block": st.verify_ms / max(st.blocks, 1),
                        "block_ms": (st.elapsed_s * 1e3 - st.prefill_ms) / max(st.blocks, 1)}

            ask(prompts[0], "draft")  # first contact: sessions opened, shapes compiled
            runs = []
            for text in prompts:
                runs.append({"prompt": text, **({"agent_alone": ask(text, "none")} if alone
                                                else {}),
                             "pair": ask(text, "draft")})
                progress(f"two agents: {text[:40]}")
            out: dict = {"runs": runs}
            if sessions > 1:
                texts = [prompts[i % len(prompts)] for i in range(sessions)]
                at_once(lambda t: ask(t, "draft"), texts)  # the batch's shapes compiled
                done = []
                for r in range(rounds):
                    for spec in ("none", "draft") if r % 2 == 0 else ("draft", "none"):
                        wall, answers = at_once(lambda t, spec=spec: ask(t, spec), texts)
                        n = sum(len(a["ids"]) for a in answers)
                        done.append({"spec": spec, "wall_s": wall, "tokens": n,
                                     "tok_s": n / wall,
                                     "drafted": sum(a["drafted"] for a in answers),
                                     "accepted": sum(a["accepted"] for a in answers),
                                     "answers": [{"prompt": t, "ids": a["ids"]}
                                                 for t, a in zip(texts, answers)]})
                        progress(f"two agents, {sessions} sessions at once, {spec}: "
                                 f"{n / wall:.2f} tok/s")
                out["sessions"] = {"n": sessions, "rounds": done}
            return out
        finally:
            local.down(Path(tmp) / "run")


# --- the two agents' cores share one memory bus here (two Macs do not) -------------------------


def _busy_verifier(verifier_dir: str, seconds: float) -> None:
    """Verify blocks of 3 tokens, one after another, for `seconds` (after a "ready" line)."""
    from macfleet.engine.models import load_model
    from macfleet.engine.verifier import Verifier

    import mlx.core as mx

    lm = load_model(verifier_dir)
    _measure_costs(lm.model, lm.model, reps=0)  # paged in
    v = Verifier(lm.model)
    v.prefill([(7 * i + 3) % lm.vocab_size for i in range(96)])
    base = v.offset
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        mx.eval(v.forward([5, 6, 7]))
        v.rollback(v.offset - base)


def draft_beside_verifier(verifier_dir: str, reps: int = 8, busy_core: int = 0) -> dict:
    """One draft-model token (ms, fastest of reps, as `_measure_costs`) on this process's core,
    alone and while the verifier verifies on `busy_core`: on one box the two agents share the
    memory bus, so each one's bandwidth-bound forward is slower beside the other than alone."""
    from macfleet.engine.models import load_model
    from macfleet.engine.verify_costs import probe_verify_costs

    draft = load_model(DRAFT_SPEC)
    _measure_costs(draft.model, draft.model, reps=0)
    alone = probe_verify_costs(draft.model, (1,), 96, reps)[1]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    busy = subprocess.Popen(
        [sys.executable, "-m", "macfleet.bench.pair_run",
         json.dumps({"mode": "busy", "dir": verifier_dir, "core": busy_core, "seconds": 600})],
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        if busy.stdout.readline().strip() != "ready":
            raise RuntimeError("the busy verifier did not start")
        beside = probe_verify_costs(draft.model, (1,), 96, reps)[1]
    finally:
        busy.kill()
        busy.wait(30)
    return {"alone": alone, "beside_verifier": beside}


def run_contention(verifier_dir: str, core: int = 1, busy_core: int = 0) -> dict:
    """`draft_beside_verifier` in a child pinned to `core` (one BLAS thread)."""
    return _pinned_child({"mode": "contention", "dir": verifier_dir, "core": core,
                          "busy_core": busy_core})


def main(argv: Sequence[str]) -> None:
    a = json.loads(argv[0])
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a["core"]})
    mode = a.get("mode", "one")
    if mode == "busy":
        _busy_verifier(a["dir"], a["seconds"])
    elif mode == "contention":
        print(json.dumps(draft_beside_verifier(a["dir"], busy_core=a["busy_core"])))
    else:
        print(json.dumps(one_process(a["dir"], a["prompts"], a["tokens"], a["k"], a["plain"],
                                     a.get("draft", DRAFT_SPEC))))


if __name__ == "__main__":
    main(sys.argv[1:])
