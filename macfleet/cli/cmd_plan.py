"""`macfleet plan`: which topologies this fleet allows, where each role goes, predicted tok/s.

A thin shell over `macfleet.topology`: the planning inputs (measured profiles from `results/`,
the model's shape, a live fleet from discover + probe) come from topology/inputs.py, or the fleet
from `--simulate HOSTS.json`; the pure planner plans; this prints. Asking for the split-sequence topology prints the refusal
and exits 3.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from macfleet.cli.cmd_fleet import NO_AGENTS_HINT
from macfleet.cli.common import UserError, add_key_args, fleet_key

RESULTS_DIR = Path("results")
EXIT_REFUSED = 3


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan topologies for the fleet and predict tokens/s")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default=None,
                   help="smollm2 (default) or an mlx-lm model directory (reads config.json)")
    p.add_argument("--proposer", default=None, metavar="KIND",
                   help="the drafter kind to plan with: ngram, layerskip, eagle, draft "
                   "(default: each)")
    p.add_argument("--simulate", default=None, metavar="HOSTS.json",
                   help="plan for a described fleet (see macfleet/topology/examples/; "
                   "default: the live fleet)")
    p.add_argument("--split-sequence", action="store_true",
                   help="ask for one sequence split across verifiers (refused, exit 3)")
    p.add_argument("--sampling", action="store_true",
                   help="drafts carry probabilities (temperature > 0): bigger F2")
    p.add_argument("--results", default=str(RESULTS_DIR), help="where measured profiles are")
    p.add_argument("--wait", type=float, default=2.0, help="seconds to browse (live fleet)")
    add_key_args(p, open_help="an unauthenticated fleet")
    p.set_defaults(func=run_plan)


def live_fleet(args, profile, shape):
    """The discovered agents that answer, as the planner's fleet (topology/inputs.py)."""
    from macfleet.fleet.client import members, probe
    from macfleet.topology.inputs import fleet_from_statuses

    key = fleet_key(args)
    statuses = [probe(c, key) for c in members(key, wait_s=args.wait)]
    live = [s for s in statuses if s.alive]
    if not live:
        raise UserError(f"no live agents found after {args.wait:.1f} s. {NO_AGENTS_HINT}; or "
                        "plan a described fleet with --simulate HOSTS.json")
    return fleet_from_statuses(live, profile, shape)


def plan_to_dict(q) -> dict:
    d = asdict(q)
    if q.cost is not None:
        d["cost"]["block_ms"] = round(q.cost.block_ms, 3)
        d["cost"]["overhead_share"] = round(q.cost.overhead_share, 4)
    return d


def run_plan(args) -> int:
    from macfleet.topology import (SnapshotError, plan, refuse_split_sequence,
                                   snapshot_from_dict)

    if args.split_sequence:
        r = refuse_split_sequence()
        if args.json:
            print(json.dumps({"refused": plan_to_dict(r)}, indent=2))
        print(f"macfleet plan: {r.topology}: {r.reason}", file=sys.stderr)
        return EXIT_REFUSED
    from macfleet.topology.disagg import plan_disagg
    from macfleet.topology.inputs import ModelShapeError, measured_profile, model_shape

    profile = measured_profile(Path(args.results))
    try:
        shape = model_shape(args.model)
    except ModelShapeError as e:
        raise UserError(str(e)) from None
    try:
        if args.simulate:
            try:
                raw = json.loads(Path(args.simulate).read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"cannot read {args.simulate}: {e}") from None
            fleet = snapshot_from_dict(raw, None if "profile" in raw else profile)
            if args.model:
                fleet = replace(fleet, model=shape)
        else:
            fleet = live_fleet(args, profile, shape)
        plans = plan(fleet, proposer=args.proposer, with_probs=args.sampling)
        disagg = plan_disagg(fleet)
    except SnapshotError as e:
        raise UserError(str(e)) from None
    if args.json:
        print(json.dumps({"model": asdict(fleet.model), "profile_source": fleet.profile.source,
                          "hosts": [asdict(h) for h in fleet.hosts],
                          "plans": [plan_to_dict(q) for q in plans],
                          "disagg": [asdict(d) for d in disagg]}, indent=2))
        return 0
    print(f"model {fleet.model.name}: {fleet.model.param_bytes / 1e9:.2f} GB, "
          f"{fleet.model.layers} layers, {fleet.model.heads}/{fleet.model.kv_heads} heads; "
          f"{len(fleet.hosts)} hosts")
    print(f"profile: {fleet.profile.source}\n")
    import shutil

    from macfleet.cli import plan_text

    for row in plan_text.table(plans, shutil.get_terminal_size((100, 24)).columns):
        print(row.rstrip())
    for q in plans:  # a mixture of experts: why expert, tensor or pipeline (topology/moe.py)
        for note in q.notes:
            if note.startswith("MoE:"):
                print(f"\nsharded over {q.n}, {note}")
    print("\nlong prompts (prefill/decode disaggregation, topology/disagg.py):")
    for d in disagg:
        where = (f"on prefill agent {d.prefill_host}" if d.decision.remote
                 else f"on the verifier ({d.verifier})")
        print(f"  {d.prompt_tokens:>6,d} tokens: prefill {where}: {d.decision.reason}")
    best = plan_text.chosen(plans)
    if best is not None:
        print(f"\nto build the first plan ({best.topology}, {best.n}):")
        steps = plan_text.commands(best, args.model or fleet.model.name)
        hw = max(len(h) for h, _ in steps)
        for host, cmd in steps:
            print(f"  on {host + ':':{hw + 1}s} {cmd}")
        print("  (the same fleet key on every Mac: `macfleet key export | ssh HOST macfleet key "
              "import`)")
    return 0
