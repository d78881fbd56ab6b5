"""Which drafter a verifier gets by default: the one measured best for it.

`macfleet bench drafter` measures every drafter side by side on held-out prompts and records
the winner in the shipped head's `.eval.json` (`bench.best`, with its speedup); `macfleet
distill` records the head's held-out acceptance there. The default proposer of `generate`,
of the fleet (`macfleet up` agents serve what the client asks for) and of the demo is read from
that record here, in one place. Without a bench record, a head that clears break-even on its
held-out acceptance drafts dynamic trees next to n-gram lookup; otherwise n-gram alone.
"""

from __future__ import annotations

from macfleet.engine.drafter.distill import read_eval
from macfleet.engine.drafter.proposer import default_head_path

AUTO = "auto"
FALLBACK = "ngram"
# Held-out mean accepted tokens per block of 4 below which a head costs more verify work than
# it saves (draft ~5% of a step per token, verify(5) ~1.1x verify(1) on the slowest machine).
MIN_HEAD_MEAN_ACCEPTED = 0.5


LOCAL, FLEET = "local", "fleet"  # where the drafter runs: the verifier's process, or an agent


def choose_proposer(head_eval: dict | None, where: str = LOCAL) -> tuple[str, str]:
    """Pure: (proposer spec, why) from a head's recorded figures (None: no head). In one
    process a drafter's time adds to every block; on a proposer agent it runs beside the
    verifier, so the best drafter differs and is measured (and recorded) for each."""
    if head_eval is None:
        return FALLBACK, "no trained draft head is shipped for this model"
    bench = head_eval.get("bench") or {}
    fleet = where == FLEET and bench.get("best_agents")
    best = bench.get("best_agents") if fleet else bench.get("best")
    if best:
        speedup = float(bench.get("speedup_agents" if fleet else "speedup", 0.0))
        return str(best), (f"measured best {'across agents' if fleet else 'in one process'} "
                           f"by `macfleet bench drafter`: {speedup:.2f}x plain decoding")
    m = float(head_eval.get("held_out", {}).get("mean_accepted", 0.0))
    if m >= MIN_HEAD_MEAN_ACCEPTED:
        return "eagle2+ngram", (f"dynamic trees of the shipped draft head (accepts {m:.2f} "
                                f"tokens per block of 4 held out) beside n-gram lookup")
    return FALLBACK, (f"the shipped draft head accepts only {m:.2f} tokens per block held out "
                      f"(< {MIN_HEAD_MEAN_ACCEPTED}): n-gram lookup is the better drafter")


def shipped_head_eval(model: str) -> dict | None:
    path = default_head_path(model)
    return read_eval(path) if path is not None and path.is_file() else None


def resolve_proposer(spec: str, model: str, where: str = LOCAL) -> tuple[str, str]:
    """`auto` -> the measured best drafter for `model` run `where`; anything else is kept."""
    if spec != AUTO:
        return spec, "asked for"
    return choose_proposer(shipped_head_eval(model), where)
