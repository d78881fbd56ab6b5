"""The planner: a fleet snapshot -> the topologies it allows, each placed and priced.

Pure: `plan(fleet, ...)` returns `Plan`s (feasible first, fastest first) and always the one
topology the physics forbids, as a refusal. The CLI prints them; agents may act on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from macfleet.topology.cost import (BlockCost, best_k, chip_bandwidth, chip_factor,
                                    dispatch_floor_ms, expected_tokens, expected_tokens_tree,
                                    shard_ms, verify_ms_on, wire_ms)
from macfleet.topology.fleet_spec import Fleet, Host, ModelShape, ProposerProfile
from macfleet.topology.moe import bytes_read, choose_moe_mode, expert_range, expert_time_share

SINGLE = "single host"
ONE_TO_ONE = "1 proposer : 1 verifier"
N_TO_ONE = "N proposers : 1 verifier"
ONE_TO_N = "1 proposer : N verifier sessions"
SHARDED = "verifier sharded over N"
SPLIT_SEQUENCE = "one sequence split across N independent verifiers"
TOPOLOGIES = (SINGLE, ONE_TO_ONE, N_TO_ONE, ONE_TO_N, SHARDED, SPLIT_SEQUENCE)

SPLIT_SEQUENCE_REFUSAL = (
    "refused: one sequence cannot be split across independent verifiers. Decoding is causal: "
    "token N+1 is computed from token N, so the verifiers would wait on each other in turn and "
    "the fleet would run no faster than one of them (plus the wire). What the fleet can do "
    "instead: shard ONE verifier over several Macs (to fit a bigger model), give one verifier "
    "several proposers (more accepted tokens per forward), or serve several independent "
    "sequences at once (throughput).")

ROLE_VERIFIER = "verifier"
ROLE_PROPOSER = "proposer"
ROLE_SHARD = "shard"
DEFAULT_MAX_PROPOSERS = 4
DEFAULT_MAX_SESSIONS = 8
MOE_PLAN_TOKENS = 4  # a MoE's shard mode is chosen for a typical verify block (1 + k drafts)


class Refused(ValueError):
    """A topology the physics forbids; the message says why and what to do instead."""


@dataclass(frozen=True)
class RoleAssignment:
    host: str
    role: str  # verifier | proposer:<kind> | shard <i>/<n> (layers a-b | heads a-b)
    mem_need: int
    mem_free: int

    @property
    def fits(self) -> bool:
        return self.mem_need <= self.mem_free


@dataclass(frozen=True)
class Plan:
    topology: str
    feasible: bool
    placement: tuple[RoleAssignment, ...] = ()
    cost: BlockCost | None = None
    tokens_per_s: float = 0.0  # aggregate (sum over sessions for ONE_TO_N)
    per_session_tokens_per_s: float = 0.0
    proposer: str = ""
    n: int = 1  # proposers, sessions or shards
    shard_mode: str = ""  # tensor | pipeline
    reason: str = ""  # why infeasible, or the refusal
    notes: tuple[str, ...] = field(default=())


def refuse_split_sequence() -> Plan:
    return Plan(SPLIT_SEQUENCE, False, reason=SPLIT_SEQUENCE_REFUSAL)


def shard_mode(model: ModelShape, n: int) -> str:
    """Tensor-parallel when heads, kv-heads (and the MLP width) divide by n, else pipeline."""
    inter_ok = model.intermediate == 0 or model.intermediate % n == 0
    if model.heads % n == 0 and model.kv_heads % n == 0 and inter_ok:
        return "tensor"
    return "pipeline"


def layer_ranges(layers: int, n: int) -> list[tuple[int, int]]:
    """n contiguous [start, end) ranges, sizes differing by at most one."""
    q, r = divmod(layers, n)
    out, s = [], 0
    for i in range(n):
        e = s + q + (1 if i < r else 0)
        out.append((s, e))
        s = e
    return out


def _offers(h: Host, role: str) -> bool:
    return not h.roles or role in h.roles


def _verifier_need(fleet: Fleet, fraction: float = 1.0) -> int:
    from macfleet.topology.fleet_spec import DEFAULT_MEM_OVERHEAD

    return int(fleet.model.param_bytes * fraction * DEFAULT_MEM_OVERHEAD)


def _proposer_need(fleet: Fleet, p: ProposerProfile) -> int:
    return _verifier_need(fleet, p.mem_fraction)


def _spec_cost(fleet: Fleet, v: Host, p: ProposerProfile, p_host: Host | None,
               with_probs: bool, n_props: int = 1, sessions: int = 1, shard_n: int = 1,
               mode: str = "", shard_hosts: tuple[Host, ...] = ()) -> BlockCost:
    """Best-k block cost of speculative decoding with the verifier led by host v."""
    vocab = fleet.model.vocab
    same = p_host is None or p_host.name == v.name
    link = fleet.link(v.name, p_host.name) if not same else fleet.link(v.name, v.name)
    c = p.ms_per_token * (chip_factor(p_host.chip, fleet.profile.ref_chip) if p_host else 1.0)

    def verify(L: int) -> float:
        if shard_hosts and mode == "pipeline":
            rngs = layer_ranges(fleet.model.layers, len(shard_hosts))
            base = fleet.profile.verify(L)
            return sum(base * (e - s) / fleet.model.layers
                       * chip_factor(h.chip, fleet.profile.ref_chip)
                       for h, (s, e) in zip(shard_hosts, rngs))
        chip = max(shard_hosts or (v,), key=lambda h: chip_factor(h.chip, fleet.profile.ref_chip))
        return verify_ms_on(fleet.profile, L, chip.chip, shard_n, mode,
                            expert_time_share(fleet.model, L))

    def sh(L: int) -> float:
        if not shard_hosts:
            return 0.0
        worst = max(fleet.link(a.name, b.name).rtt_ms for a, b in
                    zip(shard_hosts, shard_hosts[1:] + shard_hosts[:1]))
        ln = next(fleet.link(a.name, b.name) for a, b in
                  zip(shard_hosts, shard_hosts[1:] + shard_hosts[:1])
                  if fleet.link(a.name, b.name).rtt_ms == worst)
        return shard_ms(fleet.model, mode, shard_n, L, ln)

    def cost(k: int) -> BlockCost:
        L = 1 + n_props * k
        vms = verify(L)
        e = expected_tokens_tree(p.acceptance, k, n_props) if n_props > 1 else \
            expected_tokens(p.acceptance, k)
        draft_total = k * c * sessions  # one proposer serves every session in turn
        if k == 0:
            draft = 0.0
        elif same:
            draft = draft_total
        else:
            draft = max(0.0, draft_total - vms)  # cross-round: hidden behind verify
        wire = wire_ms(link, k, e, vocab, with_probs) if k and not same else 0.0
        return BlockCost(k=k, tokens_per_block=e, verify_ms=vms, draft_ms=draft, wire_ms=wire,
                         shard_ms=sh(L))

    return best_k(cost)


def _plan_single(fleet: Fleet, p: ProposerProfile, with_probs: bool) -> Plan:
    best: Plan | None = None
    need = _verifier_need(fleet) + _proposer_need(fleet, p)
    for v in fleet.hosts:
        if not _offers(v, ROLE_VERIFIER) or need > v.mem_free:
            continue
        cost = _spec_cost(fleet, v, p, None, with_probs)
        cand = Plan(SINGLE, True,
                    placement=(RoleAssignment(v.name, f"verifier+proposer:{p.kind}", need,
                                              v.mem_free),),
                    cost=cost, tokens_per_s=cost.tokens_per_s,
                    per_session_tokens_per_s=cost.tokens_per_s, proposer=p.kind)
        if best is None or cand.tokens_per_s > best.tokens_per_s:
            best = cand
    return best or Plan(SINGLE, False, reason=f"no host has {need / 1e9:.2f} GB free for the "
                        f"verifier and a {p.kind} proposer")


def _verifier_hosts(fleet: Fleet) -> list[Host]:
    need = _verifier_need(fleet)
    return [h for h in fleet.hosts if _offers(h, ROLE_VERIFIER) and h.mem_free >= need]


def _proposer_hosts(fleet: Fleet, p: ProposerProfile, exclude: str) -> list[Host]:
    need = _proposer_need(fleet, p)
    return [h for h in fleet.hosts if h.name != exclude and _offers(h, ROLE_PROPOSER)
            and h.mem_free >= need]


def _no_verifier(fleet: Fleet, topo: str) -> Plan:
    return Plan(topo, False, reason=f"no host has {_verifier_need(fleet) / 1e9:.2f} GB free for "
                f"the whole verifier ({fleet.model.name}); see '{SHARDED}'")


def _plan_one_to_one(fleet: Fleet, p: ProposerProfile, with_probs: bool) -> Plan:
    best: Plan | None = None
    vs = _verifier_hosts(fleet)
    if not vs:
        return _no_verifier(fleet, ONE_TO_ONE)
    for v in vs:
        for ph in _proposer_hosts(fleet, p, v.name):
            cost = _spec_cost(fleet, v, p, ph, with_probs)
            cand = Plan(ONE_TO_ONE, True, placement=(
                RoleAssignment(v.name, ROLE_VERIFIER, _verifier_need(fleet), v.mem_free),
                RoleAssignment(ph.name, f"proposer:{p.kind}", _proposer_need(fleet, p),
                               ph.mem_free)), cost=cost, tokens_per_s=cost.tokens_per_s,
                per_session_tokens_per_s=cost.tokens_per_s, proposer=p.kind)
            if best is None or cand.tokens_per_s > best.tokens_per_s:
                best = cand
    return best or Plan(ONE_TO_ONE, False, reason="no second host can run the proposer")


def _plan_n_to_one(fleet: Fleet, p: ProposerProfile, with_probs: bool, max_n: int) -> list[Plan]:
    vs = _verifier_hosts(fleet)
    if not vs:
        return [_no_verifier(fleet, N_TO_ONE)]
    out = []
    for n in range(2, max_n + 1):
        best: Plan | None = None
        for v in vs:
            props = sorted(_proposer_hosts(fleet, p, v.name),
                           key=lambda h: fleet.link(v.name, h.name).rtt_ms)[:n]
            if len(props) < n:
                continue
            slowest = max(props, key=lambda h: (fleet.link(v.name, h.name).rtt_ms,
                                                chip_factor(h.chip, fleet.profile.ref_chip)))
            cost = _spec_cost(fleet, v, p, slowest, with_probs, n_props=n)
            place = (RoleAssignment(v.name, ROLE_VERIFIER, _verifier_need(fleet), v.mem_free),
                     *(RoleAssignment(h.name, f"proposer:{p.kind}", _proposer_need(fleet, p),
                                      h.mem_free) for h in props))
            cand = Plan(N_TO_ONE, True, placement=place, cost=cost,
                        tokens_per_s=cost.tokens_per_s,
                        per_session_tokens_per_s=cost.tokens_per_s, proposer=p.kind, n=n, notes=(
                            f"token tree of {n} branches x k={cost.k} verified in one forward of "
                            f"{1 + n * cost.k}; acceptance = best branch (branches assumed "
                            "independent: optimistic)",))
            if best is None or cand.tokens_per_s > best.tokens_per_s:
                best = cand
        if best:
            out.append(best)
    return out or [Plan(N_TO_ONE, False, reason="fewer than 2 hosts can run a proposer beside "
                        "the verifier")]


def _plan_one_to_n(fleet: Fleet, p: ProposerProfile, with_probs: bool, max_n: int) -> list[Plan]:
    vs = _verifier_hosts(fleet)
    out = []
    for ph in [h for h in fleet.hosts if _offers(h, ROLE_PROPOSER)
               and h.mem_free >= _proposer_need(fleet, p)]:
        others = [v for v in vs if v.name != ph.name]
        for n in range(2, min(max_n, len(others)) + 1):
            chosen = sorted(others, key=lambda v: fleet.link(v.name, ph.name).rtt_ms)[:n]
            costs = [_spec_cost(fleet, v, p, ph, with_probs, sessions=n) for v in chosen]
            agg = sum(c.tokens_per_s for c in costs)
            worst = min(costs, key=lambda c: c.tokens_per_s)
            place = (RoleAssignment(ph.name, f"proposer:{p.kind}", _proposer_need(fleet, p),
                                    ph.mem_free),
                     *(RoleAssignment(v.name, f"verifier (session {i + 1})",
                                      _verifier_need(fleet), v.mem_free)
                       for i, v in enumerate(chosen)))
            cand = Plan(ONE_TO_N, True, placement=place, cost=worst, tokens_per_s=agg,
                        per_session_tokens_per_s=worst.tokens_per_s, proposer=p.kind, n=n,
                        notes=(f"{n} independent sequences; the proposer drafts for each in "
                               "turn (its time is shared)",))
            prev = next((q for q in out if q.n == n), None)
            if prev is None or cand.tokens_per_s > prev.tokens_per_s:
                out = [q for q in out if q.n != n] + [cand]
    return out or [Plan(ONE_TO_N, False, reason="needs one proposer host and >= 2 other hosts "
                        "that each fit the verifier")]


def _plan_sharded(fleet: Fleet, p: ProposerProfile, with_probs: bool) -> list[Plan]:
    cands = sorted((h for h in fleet.hosts if _offers(h, ROLE_SHARD) or _offers(h, ROLE_VERIFIER)),
                   key=lambda h: -h.mem_free)
    out = []
    for n in range(2, len(cands) + 1):
        mode = shard_mode(fleet.model, n)
        hosts = tuple(cands[:n])
        moe_why: tuple[str, ...] = ()
        if fleet.model.experts:  # a MoE: expert, tensor or pipeline, priced (topology/moe.py)
            ring = max((fleet.link(a.name, b.name) for a, b in
                        zip(hosts, hosts[1:] + hosts[:1])), key=lambda ln: ln.rtt_ms)
            vms = fleet.profile.verify(MOE_PLAN_TOKENS)
            floor = dispatch_floor_ms(vms, bytes_read(fleet.model, MOE_PLAN_TOKENS),
                                      chip_bandwidth(fleet.profile.ref_chip))
            choice = choose_moe_mode(fleet.model, n, [h.mem_free for h in hosts], ring, vms,
                                     MOE_PLAN_TOKENS, floor_ms=floor)
            mode, moe_why = choice.mode or mode, (f"MoE: {choice.reason}",)
        if mode == "expert":
            spans = [expert_range(fleet.model.experts, n, i) for i in range(n)]
            rest = 1 - fleet.model.expert_bytes / fleet.model.param_bytes
            fr = [rest + (b - a) / fleet.model.experts * (1 - rest) for a, b in spans]
            labels = [f"shard {i + 1}/{n} (experts {a}-{b - 1})" for i, (a, b) in enumerate(spans)]
        elif mode == "tensor":
            fr = [1.0 / n] * n
            labels = [f"shard {i + 1}/{n} (heads {i * fleet.model.heads // n}-"
                      f"{(i + 1) * fleet.model.heads // n - 1})" for i in range(n)]
        else:
            rngs = layer_ranges(fleet.model.layers, n)
            fr = [(e - s) / fleet.model.layers for s, e in rngs]
            labels = [f"shard {i + 1}/{n} (layers {s}-{e - 1})" for i, (s, e) in enumerate(rngs)]
        place = tuple(RoleAssignment(h.name, lab, _verifier_need(fleet, f), h.mem_free)
                      for h, lab, f in zip(hosts, labels, fr))
        if not all(r.fits for r in place):
            out.append(Plan(SHARDED, False, place, n=n, shard_mode=mode, reason=(
                f"{mode} over {n}: " + ", ".join(f"{r.host} needs {r.mem_need / 1e9:.2f} GB, "
                                                  f"has {r.mem_free / 1e9:.2f}"
                                                  for r in place if not r.fits))))
            continue
        rest = [h for h in fleet.hosts if h not in hosts and _offers(h, ROLE_PROPOSER)
                and h.mem_free >= _proposer_need(fleet, p)]
        ph = min(rest, key=lambda h: fleet.link(hosts[0].name, h.name).rtt_ms) if rest else None
        cost = _spec_cost(fleet, hosts[0], p, ph, with_probs, shard_n=n, mode=mode,
                          shard_hosts=hosts)
        if ph:
            place += (RoleAssignment(ph.name, f"proposer:{p.kind}", _proposer_need(fleet, p),
                                     ph.mem_free),)
        out.append(Plan(SHARDED, True, place, cost, cost.tokens_per_s, cost.tokens_per_s, p.kind,
                        n, mode, notes=(f"{mode} parallel: {shard_ms_note(mode)}",
                                        f"shard traffic {cost.shard_ms:.1f} ms per block",
                                        *moe_why)))
    return out or [Plan(SHARDED, False, reason="needs >= 2 hosts")]


def shard_ms_note(mode: str) -> str:
    if mode == "expert":
        return ("whole experts per rank, attention and routers replicated; 1 all-reduce per "
                "MoE layer")
    return ("2 all-reduces per layer over the ring" if mode == "tensor"
            else "activations hop rank to rank once per forward; stages run in turn")


def plan(fleet: Fleet, *, proposer: str | None = None, with_probs: bool = False,
         max_proposers: int = DEFAULT_MAX_PROPOSERS,
         max_sessions: int = DEFAULT_MAX_SESSIONS,
         topologies: tuple[str, ...] = TOPOLOGIES) -> list[Plan]:
    """Every requested topology, placed and priced; feasible ones first, fastest first.

    `proposer`: a proposer kind from the profile, or None for the best-accepting per topology.
    The split-sequence topology is always answered with its refusal.
    """
    kinds = [fleet.profile.proposer(proposer)] if proposer else list(fleet.profile.proposers)
    out: list[Plan] = []
    for topo in topologies:
        if topo == SPLIT_SEQUENCE:
            out.append(refuse_split_sequence())
            continue
        per_kind: list[list[Plan]] = []
        for p in kinds:
            if topo == SINGLE:
                per_kind.append([_plan_single(fleet, p, with_probs)])
            elif topo == ONE_TO_ONE:
                per_kind.append([_plan_one_to_one(fleet, p, with_probs)])
            elif topo == N_TO_ONE:
                per_kind.append(_plan_n_to_one(fleet, p, with_probs,
                                               min(max_proposers, len(fleet.hosts) - 1)))
            elif topo == ONE_TO_N:
                per_kind.append(_plan_one_to_n(fleet, p, with_probs, max_sessions))
            elif topo == SHARDED:
                per_kind.append(_plan_sharded(fleet, p, with_probs))
            else:
                raise ValueError(f"unknown topology '{topo}'; known: {TOPOLOGIES}")
        # per (topology, n): the best proposer kind
        best: dict[int, Plan] = {}
        for plans in per_kind:
            for q in plans:
                cur = best.get(q.n)
                if cur is None or (q.feasible, q.tokens_per_s) > (cur.feasible, cur.tokens_per_s):
                    best[q.n] = q
        out.extend(best[n] for n in sorted(best))
    order = {t: i for i, t in enumerate(TOPOLOGIES)}
    return sorted(out, key=lambda q: (not q.feasible, q.topology == SPLIT_SEQUENCE,
                                      -q.tokens_per_s, order.get(q.topology, 99)))


def best_plan(plans: list[Plan]) -> Plan | None:
    """The fastest single-sequence plan (ONE_TO_N buys throughput, not one request's speed)."""
    return next((q for q in plans if q.feasible and q.topology != ONE_TO_N), None)

