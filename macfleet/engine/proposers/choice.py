"""Which drafter `auto` means: the one measured best for this verifier and machine, or in one
process and the serving engine the prior of the drafter chosen per block (docs/drafters.md,
"choice.py")."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from macfleet.engine.cachedir import cache_root, machine_id, write_atomic
from macfleet.engine.chooser import Prior
from macfleet.engine.proposers.eagle.head import read_eval
from macfleet.engine.proposers.shipped import default_head_path

AUTO = "auto"
FALLBACK = "ngram"
# held-out mean accepted tokens per block of 4 below which a head costs more verify work than
# it saves (docs/benchmarks.md, Drafters)
MIN_HEAD_MEAN_ACCEPTED = 0.5

LOCAL, FLEET = "local", "fleet"  # where the drafter runs: the verifier's process, or an agent


def choose_proposer(head_eval: dict | None, where: str = LOCAL, mine: dict | None = None,
                    here: str = "") -> tuple[str, str]:
    """Pure: (proposer spec, why) from a head's recorded figures (None: no head) and this
    machine's own bench record (`mine`, which wins); `here`: this machine's `machine_id`.
    `where`: one process and a proposer agent each have their own measured best."""
    bench = mine or (head_eval or {}).get("bench") or {}
    fleet = where == FLEET and bench.get("best_agents")
    best = bench.get("best_agents") if fleet else bench.get("best")
    if best:
        speedup = float(bench.get("speedup_agents" if fleet else "speedup", 0.0))
        local = bool(mine) or (bool(here) and bench.get("machine") == here)
        on = "this machine" if local else bench.get("machine") or "a reference machine"
        why = (f"measured best {'across agents' if fleet else 'in one process'} on {on} by "
               f"`macfleet bench drafter`: {speedup:.2f}x plain decoding")
        if not local:
            why += "; `macfleet bench drafter --record` measures this machine"
        return str(best), why
    if head_eval is None:
        return FALLBACK, "no trained draft head is shipped for this model"
    m = float(head_eval.get("held_out", {}).get("mean_accepted", 0.0))
    if m >= MIN_HEAD_MEAN_ACCEPTED:
        return "eagle2+ngram", (f"dynamic trees of the shipped draft head (accepts {m:.2f} "
                                f"tokens per block of 4 held out) beside n-gram lookup")
    return FALLBACK, (f"the shipped draft head accepts only {m:.2f} tokens per block held out "
                      f"(< {MIN_HEAD_MEAN_ACCEPTED}): n-gram lookup is the better drafter")


def machine_record_path(model: str) -> Path:
    return cache_root() / "drafter-choice" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', model)}.json"


def machine_record(model: str) -> dict | None:
    """This machine's own bench record for `model`, None when it was not measured here."""
    try:
        doc = json.loads(machine_record_path(model).read_text())
    except (OSError, ValueError):
        return None
    mine = isinstance(doc, dict) and doc.get("machine") == machine_id()
    return doc if mine and doc.get("best") else None


def record_machine_choice(model: str, bench: dict) -> Path:
    """Keep `bench` (best, speedup, best_agents, ...) as this machine's record for `model`."""
    path = machine_record_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({**bench, "machine": machine_id()}, indent=2) + "\n")
    return path


def shipped_head_eval(model: str) -> dict | None:
    path = default_head_path(model)
    return read_eval(path) if path is not None and path.is_file() else None


def prior_from(head_eval: dict | None, mine: dict | None = None) -> dict[str, Prior]:
    """Pure: the bench record as the chooser's prior (engine/chooser.py): its winner at its
    measured speedup, every drafter it measured (`drafters`) at its acceptance."""
    bench = mine or (head_eval or {}).get("bench") or {}
    best, speedup = bench.get("best"), float(bench.get("speedup") or 0.0)
    out: dict[str, Prior] = {}
    for name, f in (bench.get("drafters") or {}).items():
        try:
            accepted, verified = float(f["accepted"]), float(f["verified"])
        except (KeyError, TypeError, ValueError):
            continue
        if accepted >= 0 and verified >= 1:
            out[str(name)] = Prior(accepted=accepted, verified=verified)
    if best and speedup > 0:
        out[str(best)] = replace(out.get(str(best), Prior()), speedup=speedup)
    return out


def auto_prior(model: str) -> dict[str, Prior]:
    """This machine's bench record for `model`, else the shipped one, as the chooser's prior."""
    return prior_from(shipped_head_eval(model), machine_record(model))


def resolve_proposer(spec: str, model: str, where: str = LOCAL) -> tuple[str, str]:
    """`auto` -> the measured best drafter for `model` run `where`; anything else is kept."""
    if spec != AUTO:
        return spec, "asked for"
    return choose_proposer(shipped_head_eval(model), where, machine_record(model), machine_id())
