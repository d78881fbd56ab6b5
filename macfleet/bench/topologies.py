"""`macfleet bench topologies`: the planner's predicted tokens/s next to measured tokens/s.

For every topology that can run on this machine:

  single host            verifier + proposer in this process (macfleet's loop)
  1 proposer : 1 verifier    two agents
  N proposers : 1 verifier   one verifier, N=2 proposer agents, a token tree ("ngram+layerskip:K")
  verifier sharded over N    2 pipeline ranks (mlx.distributed ring on loopback) + a proposer

the planner is given a Fleet built from the agents' own cards (chip, free memory, roles), links
with the RTT measured by Ping and a bandwidth taken from `results/f3_overhead.json` (loopback)
when present, and the profile the CLI passes in (measured `verify(L)` when
`results/verify_l_sweep.json` exists). The planner assumes each host is its own Mac; here all
agents share this machine's cores, which is part of what the error column shows.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER, AgentCard
from bridge.messages import GenerateDone
from macfleet import sysinfo
from macfleet.bench.local import run_macfleet
from macfleet.engine.models import LoadedModel
from macfleet.engine.text import encode_prompt
from macfleet.fleet import local
from macfleet.fleet.client import generate_remote, probe
from macfleet.fleet.keys import keygen
from macfleet.topology import planner
from macfleet.topology.fleet_spec import Fleet, Host, Link, Profile

DEFAULT_MAX_TOKENS = 32
DEFAULT_LAYERSKIP = 20
DEFAULT_BANDWIDTH_MB_S = 1000.0  # loopback, when no f3 measurement is at hand


@dataclass(frozen=True)
class Case:
    name: str
    topology: str  # planner topology constant
    n: int  # proposers / shards the planner should price
    kind: str  # proposer kind the planner prices
    spec: str  # proposer spec actually run


def loopback_bandwidth(results: Path) -> tuple[float, str]:
    """MB/s of the largest loopback F3 payload (round trip), else a stated default."""
    try:
        d = json.loads((results / "f3_overhead.json").read_text())
        p = max(d["links"]["loopback"], key=lambda q: q["nbytes"])
        return p["nbytes"] / (p["median_ms"] / 1e3) / 1e6, f"{results}/f3_overhead.json loopback"
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return DEFAULT_BANDWIDTH_MB_S, f"default {DEFAULT_BANDWIDTH_MB_S:.0f} MB/s"


def fleet_from_cards(cards: Sequence[AgentCard], key: bytes, profile: Profile,
                     bandwidth_mb_s: float) -> tuple[Fleet, float]:
    """The planner's Fleet for these agents; returns it and the median RTT used for links."""
    rtts = [probe(c, key).rtt_p50_ms or 0.0 for c in cards]
    hosts = tuple(Host(c.name, c.chip, c.mem_free, tuple(c.roles)) for c in cards)
    rtt = sorted(rtts)[len(rtts) // 2] if rtts else 0.0
    links = tuple(Link(a.name, b.name, rtt, bandwidth_mb_s)
                  for i, a in enumerate(hosts) for b in hosts[i + 1:])
    return Fleet(hosts, profile=profile, links=links), rtt


def predict(fleet: Fleet, case: Case) -> planner.Plan | None:
    plans = planner.plan(fleet, proposer=case.kind, topologies=(case.topology,))
    same = [q for q in plans if q.topology == case.topology and (q.n == case.n or
                                                                 case.topology == planner.SINGLE)]
    return same[0] if same else None


def _done(card: AgentCard, key: bytes, prompt: str, n: int, props: list[str],
          spec: str) -> GenerateDone:
    for msg in generate_remote(card, key, prompt=prompt, max_tokens=n, proposers=props,
                               proposer_spec=spec if props else "none"):
        if isinstance(msg, GenerateDone):
            return msg
    raise RuntimeError("no GenerateDone from the verifier")


def _measure_agents(lm: LoadedModel, case: Case, prompt: str, n: int, profile: Profile,
                    bw: float, progress) -> dict:
    agents = {planner.ONE_TO_ONE: 2, planner.N_TO_ONE: 1 + case.n, planner.SHARDED: 2}
    shard = case.n if case.topology == planner.SHARDED else 0
    with tempfile.TemporaryDirectory(prefix="macfleet-topo-") as tmp:
        key_path = Path(tmp) / "fleet.key"
        key = keygen(key_path)
        run_dir = Path(tmp) / "run"
        progress(f"{case.name}: starting agents")
        try:
            cards = local.up(agents[case.topology], model=lm.spec, key=key, key_path=key_path,
                             run_dir=run_dir, shard=shard, shard_mode="pipeline",
                             timeout_s=120.0)
        except local.FleetStartError as e:  # keep the agents' last words: tmp goes away
            tails = [f"{p.name}: ...{p.read_text(errors='replace')[-300:]}"
                     for p in sorted(run_dir.glob("*.log"))]
            raise local.FleetStartError(f"{e}\n" + "\n".join(tails)) from None
        try:
            v = next(c for c in cards if ROLE_VERIFIER in c.roles)
            props = [c.router_endpoint for c in cards if ROLE_PROPOSER in c.roles]
            _done(v, key, "Hi", 4, props, case.spec)  # warm-up
            fleet, rtt = fleet_from_cards(cards, key, profile, bw)
            r = _done(v, key, prompt, n, props, case.spec)
            alone = _done(v, key, prompt, n, [], "none")  # calibration: plain decoding
            return {"measured_tokens_per_s": r.stats.decode_tokens_per_s,
                    "verifier_alone_tokens_per_s": alone.stats.decode_tokens_per_s,
                    "acceptance": r.stats.acceptance,
                    "mean_accepted": r.stats.mean_accepted,
                    "tokens": len(r.token_ids), "rtt_ms": round(rtt, 3),
                    "hosts": [f"{c.name} ({'/'.join(c.roles)})" for c in cards],
                    "plan": predict(fleet, case)}
        finally:
            local.down(run_dir)


def _measure_single(lm: LoadedModel, case: Case, prompt: str, n: int, profile: Profile) -> dict:
    ids = encode_prompt(lm.tokenizer, prompt, chat=True)
    run_macfleet(lm, ids[:8], 4, case.spec, "auto")  # warm-up
    toks, secs, st = run_macfleet(lm, ids, n, case.spec, "auto")
    plain, plain_s, _ = run_macfleet(lm, ids, n, "none", "auto")  # calibration
    host = Host("this-machine", sysinfo.chip(), sysinfo.memory_free())
    return {"measured_tokens_per_s": len(toks) / secs, "acceptance": st.acceptance,
            "mean_accepted": st.mean_accepted, "tokens": len(toks), "rtt_ms": 0.0,
            "verifier_alone_tokens_per_s": len(plain) / plain_s,
            "hosts": ["this process (verifier+proposer)"],
            "plan": predict(Fleet((host,), profile=profile), case)}


def cases(layerskip: int = DEFAULT_LAYERSKIP) -> list[Case]:
    ls = f"layerskip:{layerskip}"
    return [Case("single host (in-process)", planner.SINGLE, 1, "layerskip", ls),
            Case("1 proposer : 1 verifier", planner.ONE_TO_ONE, 1, "layerskip", ls),
            Case("2 proposers : 1 verifier (tree)", planner.N_TO_ONE, 2, "layerskip",
                 f"ngram+{ls}"),
            Case("verifier sharded over 2 (pipeline)", planner.SHARDED, 2, "layerskip", ls)]


def bench_topologies(lm: LoadedModel, prompt: str, *, profile: Profile, results: Path,
                     max_tokens: int = DEFAULT_MAX_TOKENS, layerskip: int = DEFAULT_LAYERSKIP,
                     only: Sequence[str] = (),
                     progress: Callable[[str], None] = lambda m: None) -> dict:
    bw, bw_src = loopback_bandwidth(results)
    rows = []
    for case in cases(layerskip):
        if only and not any(o in case.name for o in only):
            continue
        try:
            if case.topology == planner.SINGLE:
                m = _measure_single(lm, case, prompt, max_tokens, profile)
            else:
                m = _measure_agents(lm, case, prompt, max_tokens, profile, bw, progress)
        except (local.FleetStartError, RuntimeError, OSError) as e:
            rows.append({"case": case.name, "topology": case.topology, "error": str(e)})
            progress(f"{case.name}: failed: {e}")
            continue
        q = m.pop("plan")
        pred = q.tokens_per_s if q is not None and q.feasible else None
        meas = m["measured_tokens_per_s"]
        row = {"case": case.name, "topology": case.topology, "proposer_spec": case.spec,
               "planner_proposer_kind": case.kind, "n": case.n,
               "predicted_tokens_per_s": round(pred, 2) if pred is not None else None,
               "measured_tokens_per_s": round(meas, 2),
               "error_pct": round(100 * (pred - meas) / meas, 1) if pred and meas else None,
               "planner_k": q.cost.k if q is not None and q.cost else None,
               "planner_expected_tokens": round(q.cost.tokens_per_block, 3)
               if q is not None and q.cost else None,
               "planner_reason": q.reason if q is not None else "no plan for this topology",
               **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}}
        rows.append(row)
        progress(f"{case.name}: predicted {row['predicted_tokens_per_s']} tok/s, measured "
                 f"{row['measured_tokens_per_s']} tok/s, error {row['error_pct']}%")
    return {"model": lm.spec, "prompt": prompt, "max_tokens": max_tokens, "rows": rows,
            "profile_source": profile.source, "link_bandwidth_source": bw_src,
            "link_bandwidth_mb_s": round(bw, 1),
            "profile_plain_tokens_per_s": round(1000 / profile.verify(1), 2),
            "notes": "error_pct = (predicted - measured) / measured. The planner prices each "
                     "agent as its own Mac; here every agent shares this machine's cores "
                     "(pinned one core each, 2 cores), the proposer kind it prices for the tree "
                     "is layerskip on both branches while the run uses ngram + layerskip, and "
                     "one short generation is measured per topology (noisy). verifier_alone_tokens_per_s (plain decoding, same "
                     "agents) next to profile_plain_tokens_per_s (1000 / profile verify(1)) "
                     "separates a wrong profile for this machine from a wrong model."}
