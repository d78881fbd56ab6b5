"""Which drafter a verifier gets by default: the one measured best for it, or, in one process
and in the serving engine, the one chosen block by block with that as the prior.

`macfleet bench drafter` measures every drafter side by side on held-out prompts. With
`--record` it keeps the winner for THIS machine (in its cache: `machine_record`); with
`--record-shipped` also in the shipped head's `.eval.json` (`bench.best`, with its speedup and
the machine it was measured on), the default everywhere else. The best drafter is a property
of the machine as much as of the model (a Mac's flat verify(L) makes trees cheap that a CPU's
does not), so a machine's own record wins over the shipped one, and a choice read from
another machine's record says so. `macfleet distill` records the head's held-out acceptance in
the eval file. The default proposer of `generate` and `serve`, of the fleet (`macfleet up`
agents serve what the client asks for) and of the demo is read here, in one place. Without a bench record,
a head that clears break-even on its held-out acceptance drafts dynamic trees next to n-gram
lookup; otherwise n-gram alone.

In one process (`generate --local`), per session in `serve --local` and in a verifier agent
(`generate` through a fleet), `auto` is no longer the record's answer but its prior
(`auto_prior`): engine/choosing.py chooses the drafter of each block as it runs (issue 44: the
best drafter moves with the machine's load and the answer being written). `serve` in front of
a fleet still sends the record's winner (`resolve_proposer`).
"""

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
# Held-out mean accepted tokens per block of 4 below which a head costs more verify work than
# it saves (a draft token and verify(5)'s extra over verify(1) priced as on the slowest machine
# measured: docs/benchmarks.md, Drafters).
MIN_HEAD_MEAN_ACCEPTED = 0.5


LOCAL, FLEET = "local", "fleet"  # where the drafter runs: the verifier's process, or an agent


def choose_proposer(head_eval: dict | None, where: str = LOCAL, mine: dict | None = None,
                    here: str = "") -> tuple[str, str]:
    """Pure: (proposer spec, why) from a head's recorded figures (None: no head) and this
    machine's own bench record (`mine`, which wins); `here`: this machine's `machine_id`. In
    one process a drafter's time adds to every block; on a proposer agent it runs beside the
    verifier, so the best drafter differs and is measured (and recorded) for each."""
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
    """This machine's own bench record for `model` (None: not measured here, or measured on
    another machine sharing this cache directory)."""
    try:
        doc = json.loads(machine_record_path(model).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("machine") != machine_id():
        return None
    return doc if doc.get("best") else None


def record_machine_choice(model: str, bench: dict) -> Path:
    """Keep `bench` (best, speedup, best_agents, speedup_agents, command) as this machine's
    record for `model`."""
    path = machine_record_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({**bench, "machine": machine_id()}, indent=2) + "\n")
    return path


def shipped_head_eval(model: str) -> dict | None:
    path = default_head_path(model)
    return read_eval(path) if path is not None and path.is_file() else None


def prior_from(head_eval: dict | None, mine: dict | None = None) -> dict[str, Prior]:
    """Pure: the offline record as the prior of the drafter chosen while it runs
    (engine/chooser.py): its winner in one process at its measured speedup over plain, and
    every drafter it measured (`drafters`: accepted drafts and tokens verified per block, in
    records since issue 44's per-candidate prior) at its acceptance."""
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
    """`auto` -> the measured best drafter for `model` run `where` (this machine's record,
    else the shipped one); anything else is kept."""
    if spec != AUTO:
        return spec, "asked for"
    return choose_proposer(shipped_head_eval(model), where, machine_record(model), machine_id())
