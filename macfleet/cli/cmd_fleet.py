"""`macfleet agent | up | down | ls | keygen`: run agents and see the fleet."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agents.specs import PROPOSER_KINDS
from macfleet.serve.scheduler import DEFAULT_STALL_RATIO
from macfleet.topology.disagg import DEFAULT_MIN_PROMPT_TOKENS
from macfleet.cli.cmd_serve import add_front_options, fleet_serve_args
from macfleet.cli.common import UserError, add_key_args, ensure_model, fleet_key

SHARD_MODES = ("tensor", "pipeline", "expert")  # agents/shard.py SHARD_MODES
KV_CODECS = ("auto", "float16", "int8")  # engine/kvship.py KV_CODECS (no MLX import here)
NO_AGENTS_HINT = ("On each Mac run `macfleet service install --role verifier` (one Mac) or "
                  "`--role proposer` (the others), or `macfleet agent --role ...` in a "
                  "terminal, with the same fleet key; `macfleet up` starts a fleet on this "
                  "machine only")


def add_parser(sub) -> None:
    a = sub.add_parser("agent", help="run the agent daemon on this machine",
                       description="The agent of one Mac: a verifier (checks drafted blocks; "
                       "the Mac with the most memory), a proposer (drafts ahead of it), a "
                       "shard of a sharded verifier, or a prefill agent. `macfleet service "
                       "install --role ROLE` keeps one running for good.")
    a.add_argument("--role", required=True, choices=("proposer", "verifier", "shard", "prefill"),
                   help="what this agent does in the fleet")
    a.add_argument("--group", default="", help="shard: the sharded verifier's group name "
                   "(default: none; a shard needs one)")
    a.add_argument("--group-size", type=int, default=0, help="shard: number of ranks")
    a.add_argument("--rank", type=int, default=0, help="shard: this agent's rank")
    a.add_argument("--shard-mode", choices=SHARD_MODES, default="pipeline",
                   help="tensor: split every layer; pipeline: split the layers; expert "
                   "(MoE models): whole experts per rank, attention and routers replicated")
    a.add_argument("--model", default="smollm2", help="the model this agent serves (a "
                   "proposer: the verifier model it drafts for)")
    a.add_argument("--draft", default=None, metavar="MODEL",
                   help="proposer: a small same-family draft model (a spec or an mlx-lm "
                   "directory) that drafts ahead for --model's verifiers while they verify; "
                   "the agent loads only this model (default: none, the usual drafters)")
    a.add_argument("--proposer-kinds", default=",".join(PROPOSER_KINDS), metavar="KIND[,KIND...]",
                   help="proposer: the drafter kinds it serves (clients name the drafter "
                   "itself with `generate --proposer`)")
    a.add_argument("--f3-codec", choices=("float16", "int8"), default="float16",
                   help="verifier: hidden states to a remote drafter as float16, or int8 "
                   "(half the bytes; see results/drafter.json for its acceptance cost)")
    a.add_argument("--heads", default=None, help="directory of draft heads clients may name "
                   "(eagle:NAME; default: none); the shipped heads are always available")
    a.add_argument("--allow-hub", action="store_true", help="let remote requests name Hugging "
                   "Face ids for draft: models (downloads); off: allowlisted names and --heads")
    a.add_argument("--name", default="", help="its name in `macfleet ls` (default: "
                   "HOST-ROLE)")
    a.add_argument("--node-id", default="", help="its id in the fleet (default: a random one "
                   "per start)")
    a.add_argument("--port", type=int, default=0, help="request port (0: any free port; the "
                   "Zeroconf card tells clients)")
    a.add_argument("--pub-port", type=int, default=0, help="metrics port (0: any free port)")
    a.add_argument("--bind", default=None, help="bind address (default 127.0.0.1 with "
                   "--loopback, else 0.0.0.0)")
    a.add_argument("--loopback", action="store_true", help="advertise on 127.0.0.1 only")
    a.add_argument("--exit-with", type=int, default=None, metavar="PID",
                   help="stop when process PID ends, however it ends (what `macfleet demo` "
                   "starts its agents with; default: run until stopped)")
    a.add_argument("--max-conns-per-peer", type=int, default=None, metavar="N",
                   help="connections one address may hold to each of the agent's ports before "
                   "they complete the handshake; over it the oldest are closed (default 64; all "
                   "connections stay within a budget of the descriptor limit; 0: no caps)")
    a.add_argument("--allow-peer", action="append", default=[], metavar="tcp://HOST:PORT",
                   help="an endpoint requests may make this agent connect to (a proposer, a "
                   "link probe's peer) besides the fleet members it discovers; tcp://HOST:* "
                   "allows every port of HOST; repeatable (default: only the discovered "
                   "members)")
    add_key_args(a)
    a.add_argument("--cpu", type=int, default=None, help="pin to this core (Linux; default: "
                   "not pinned)")
    a.add_argument("--batch-sessions", type=int, default=None, metavar="N",
                   help="verifier: sessions verified together in one forward (continuous "
                        "batching of speculative blocks; default 16); 0: one at a time")
    a.add_argument("--stall-ratio", type=float, default=None, metavar="R",
                   help="verifier: size prefill chunks so a batch iteration costs at most R "
                        "decode-only ones (default %s; 0: the token budget only)"
                        % DEFAULT_STALL_RATIO)
    a.add_argument("--draft-timeout", type=float, default=None, metavar="S",
                   help="verifier: a remote proposer's draft not back within S seconds is "
                        "dropped, and the proposer with it (default: agents/remote_proposer.py's "
                        "DEFAULT_DRAFT_TIMEOUT_S)")
    a.add_argument("--f3-probe", action="store_true", help="verifier: send a hidden-state-"
                   "sized probe with each block so the dashboard's F3 row is measured")
    a.add_argument("--kv-codec", choices=KV_CODECS, default="auto", help="verifier: how a "
                   "prefill agent's KV travels (auto: the cache's own dtype, exact)")
    a.add_argument("--prefill-min-tokens", type=int, default=DEFAULT_MIN_PROMPT_TOKENS,
                   help="verifier: shorter prompts are always prefilled here")
    a.add_argument("--no-disagg", action="store_true", help="verifier: never ship a prefill "
                   "to a prefill agent")
    a.set_defaults(func=run_agent)

    u = sub.add_parser("up", help="start a fleet on this machine (default: 1 verifier + 1 "
                       "proposer)", description="Start agents on this machine only (each a "
                       "process; `macfleet down` stops them). For a fleet of Macs run `macfleet "
                       "agent` (or `macfleet service install`) on each one instead.")
    u.add_argument("--agents", type=int, default=2,
                   help="agents to start: one verifier, the rest proposers")
    u.add_argument("--model", default="smollm2", help="the model every agent serves")
    u.add_argument("--draft", default=None, metavar="MODEL",
                   help="the proposer agents draft ahead with this draft model (a small model "
                   "of --model's family; `generate` and `serve` then use them by default; "
                   "default: none)")
    u.add_argument("--no-pin", action="store_true", help="do not pin agents to cores")
    u.add_argument("--f3-probe", action="store_true", help="the verifier measures F3 per block")
    u.add_argument("--serve", action="store_true", help="then serve the OpenAI API on it "
                   "(with the options below, which `macfleet serve` takes too)")
    u.add_argument("--batch-sessions", type=int, default=None, metavar="N",
                   help="the verifier's continuous batch: sessions per forward (default 16; "
                        "0: one session at a time)")
    u.add_argument("--stall-ratio", type=float, default=None, metavar="R",
                   help="the verifier's prefill chunks: a batch iteration costs at most R "
                        "decode-only ones (default %s)" % DEFAULT_STALL_RATIO)
    u.add_argument("--shard", type=int, default=0, metavar="N",
                   help="shard the verifier over N agents (mlx.distributed ring)")
    u.add_argument("--shard-mode", choices=SHARD_MODES, default="pipeline",
                   help="with --shard: how the model is split (see `macfleet agent --help`)")
    u.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="also start N prefill agents (long prompts' KV computed off the verifier)")
    add_key_args(u)
    add_front_options(u.add_argument_group("the API server (with --serve)"), wait_s=5.0,
                      batch_sessions=False)
    u.set_defaults(func=run_up)

    d = sub.add_parser("down", help="stop the local fleet started by `up`")
    d.set_defaults(func=run_down)

    ls = sub.add_parser("ls", help="the discovered agents: cards, heartbeat age, RTT")
    ls.add_argument("--json", action="store_true", help="print one JSON object (the same "
                    "exit status: 1 when no agent is found)")
    ls.add_argument("--wait", type=float, default=2.0, help="seconds to browse")
    add_key_args(ls)
    ls.set_defaults(func=run_ls)

    k = sub.add_parser("keygen", help="write a new fleet key")
    k.add_argument("--key", default=None, metavar="FILE",
                   help="where to write it (default: ~/.macfleet/fleet.key)")
    k.add_argument("--force", action="store_true", help="overwrite an existing key")
    k.set_defaults(func=run_keygen)


def run_agent(args) -> int:
    from agents.admission import AdmissionError
    from agents.daemon import Agent, AgentConfig
    from agents.remote_prefill import DisaggPolicy
    from macfleet.engine.models import ModelSpecError

    ensure_model(args.draft or args.model)  # a draft-model agent loads only its draft model
    key = fleet_key(args)
    bind = args.bind or ("127.0.0.1" if args.loopback else "0.0.0.0")
    cfg = AgentConfig(role=args.role, model=args.model, name=args.name, bind_host=bind,
                      port=args.port, pub_port=args.pub_port, key=key,
                      loopback_only=args.loopback, cpu=args.cpu, node_id=args.node_id,
                      proposer_kinds=tuple(k for k in args.proposer_kinds.split(",") if k),
                      draft=args.draft,
                      f3_probe=args.f3_probe, heads_dir=args.heads, f3_codec=args.f3_codec,
                      allow_hub=args.allow_hub, max_conns_per_peer=args.max_conns_per_peer,
                      batch_sessions=args.batch_sessions, allow_peers=tuple(args.allow_peer),
                      stall_ratio=None if args.stall_ratio is None
                      else check_stall_ratio(args.stall_ratio),
                      draft_timeout_s=None if args.draft_timeout is None
                      else check_draft_timeout(args.draft_timeout),
                      disagg=None if args.no_disagg else DisaggPolicy(
                          codec=args.kv_codec, min_prompt_tokens=args.prefill_min_tokens))
    try:
        if args.role == "shard":
            from agents.shard_agent import ShardAgent, ShardSpec

            if not args.group or args.group_size < 2:
                raise UserError("a shard agent needs --group NAME and --group-size N >= 2")
            agent = ShardAgent(cfg, ShardSpec(group=args.group, size=args.group_size,
                                              rank=args.rank, mode=args.shard_mode))
        else:
            agent = Agent(cfg)
    except (ModelSpecError, AdmissionError, TimeoutError, ValueError) as e:
        raise UserError(str(e)) from None
    print(f"agent {agent.name} ({args.role}, {agent.lm.spec}) serving at "
          f"{agent.card.router_endpoint}, metrics at {agent.card.pub_endpoint}", flush=True)
    if args.exit_with is not None:
        from macfleet.fleet.local import exit_with

        exit_with(args.exit_with, agent.stop)
    agent.serve_forever()
    return 0


def verifier_args(args) -> list[str]:
    """What `up` passes on to its verifier agent."""
    out = ["--f3-probe"] if args.f3_probe else []
    if args.batch_sessions is not None:
        if args.batch_sessions < 0:
            raise UserError("--batch-sessions must be >= 0")
        out += ["--batch-sessions", str(args.batch_sessions)]
    if getattr(args, "stall_ratio", None) is not None:
        out += ["--stall-ratio", str(check_stall_ratio(args.stall_ratio))]
    return out


def check_draft_timeout(s: float) -> float:
    if not 0 < s <= 600:
        raise UserError(f"--draft-timeout must be in (0, 600] seconds, got {s}")
    return s


def check_stall_ratio(r: float) -> float:
    if not 0 <= r <= 100:
        raise UserError(f"--stall-ratio must be in 0..100, got {r}")
    return r


def run_up(args) -> int:
    from macfleet.fleet import local
    from macfleet.fleet.keys import default_key_path, run_dir

    from macfleet import progress

    serve_args = fleet_serve_args(args) if args.serve else None  # bad options: before agents
    for spec in (args.model, args.draft or ""):  # once here, not in each agent
        ensure_model(spec)
    key = fleet_key(args, create=True)
    key_path = None if args.open else Path(args.key or default_key_path())

    try:
        with progress.waiting("starting the agents (each advertises itself once warm)"):
            cards = local.up(args.agents, model=args.model, key=key, key_path=key_path,
                             run_dir=run_dir(), pin=not args.no_pin,
                             extra_args={"verifier": verifier_args(args),
                                         "proposer": ["--draft", args.draft] if args.draft
                                         else []},
                             shard=args.shard, shard_mode=args.shard_mode,
                             prefill=args.prefill)
    except (local.FleetStartError, ValueError) as e:
        raise UserError(str(e)) from None
    for c in sorted(cards, key=lambda c: c.name):
        print(f"{c.name:14s} {'/'.join(c.roles):9s} {c.router_endpoint}")
    print(f"fleet up ({len(cards)} agents); `macfleet down` stops it")
    if serve_args is not None:
        from macfleet.cli.cmd_serve import run

        return run(serve_args)
    return 0


def run_down(args) -> int:
    from macfleet.fleet import local
    from macfleet.fleet.keys import run_dir

    n = local.down(run_dir())
    print(f"stopped {n} agent(s)")
    return 0


def run_ls(args) -> int:
    from macfleet.fleet.client import fleet_id, members, probe

    key = fleet_key(args)
    cards = members(key, wait_s=args.wait)  # probed: only cards whose tag checks
    statuses = [probe(c, key) for c in cards]
    rows = []
    for s in sorted(statuses, key=lambda s: s.card.name):
        c = s.card
        rows.append({
            "name": c.name, "node_id": c.node_id, "roles": list(c.roles), "models": list(c.models),
            "draft_model": c.draft_model or None,  # a draft-model agent's own model
            "endpoint": c.router_endpoint, "chip": c.chip, "alive": s.alive,
            "mem_total_gb": round(c.mem_total / 2**30, 1),
            "mem_free_gb": round(c.mem_free / 2**30, 1),
            "sessions": s.status.sessions if s.status else None,
            "uptime_s": round(s.status.uptime_s, 1) if s.status else None,
            "heartbeat_age_s": 0.0 if s.alive else None,
            "rtt_p50_ms": round(s.rtt_p50_ms, 3) if s.rtt_p50_ms is not None else None,
            "error": s.error,
        })
    if args.json:
        print(json.dumps({"fleet_id": fleet_id(key), "agents": rows}, indent=2))
        return 0 if rows else 1
    if not rows:
        print(f"no agents found in fleet {fleet_id(key)} after {args.wait:.1f} s. "
              f"{NO_AGENTS_HINT}",
              file=sys.stderr)
        return 1
    print(f"{'NAME':14s} {'ROLE':9s} {'MODEL':10s} {'ENDPOINT':24s} {'MEM FREE':>9s} "
          f"{'SESS':>4s} {'RTT ms':>7s}  STATE")
    for r in rows:
        rtt = f"{r['rtt_p50_ms']:.2f}" if r["rtt_p50_ms"] is not None else "-"
        role = "draft" if r["draft_model"] else "/".join(r["roles"])  # drafts with its own
        print(f"{r['name'][:14]:14s} {role:9s} {','.join(r['models'])[:10]:10s} "
              f"{r['endpoint']:24s} {r['mem_free_gb']:>7.1f}GB {r['sessions'] or 0:>4d} "
              f"{rtt:>7s}  {'up' if r['alive'] else 'DOWN ' + r['error'][:40]}")
    return 0


def run_keygen(args) -> int:
    from macfleet.fleet.client import fleet_id
    from macfleet.fleet.keys import keygen
    from macfleet.fleet.keys import default_key_path

    path = Path(args.key or default_key_path())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = keygen(path, overwrite=args.force)
    except FileExistsError:
        raise UserError(f"{path} exists; use --force to replace it (agents with the old key "
                        "will refuse clients with the new one)") from None
    print(f"wrote {path} (fleet id {fleet_id(key)}); give every Mac of the fleet the same key: "
          "`macfleet key export | ssh mac2 macfleet key import`")
    return 0
