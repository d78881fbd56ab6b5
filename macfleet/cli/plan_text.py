"""`macfleet plan`'s text: the table of plans (the last column wrapped to the terminal, nothing
cut), and the commands that build the plan it chose. Pure functions of the planner's records."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

from macfleet.topology import SPLIT_SEQUENCE

MIN_LAST_COLUMN = 40  # narrower: the placement / why-not text goes under each row instead
SHARD_GROUP = "plan"  # the group name the printed shard commands use
# a proposer kind -> a --proposer spec `generate` takes (the planner's kinds take no argument)
PROPOSER_SPECS = {"layerskip": "layerskip:K", "draft": "draft:MODEL"}
_SHARD_RE = re.compile(r"shard (\d+)/(\d+)")


def table(plans: Sequence, width: int) -> list[str]:
    """The plans as rows: the topology column as wide as its longest name, the last column
    (placement, or why not) wrapped under itself, or under the row on a narrow terminal; the
    refused split-sequence topology as a paragraph after them."""
    tw = max([len("TOPOLOGY"), *(len(q.topology) for q in plans
                                  if q.topology != SPLIT_SEQUENCE)])
    head = (f"{'TOPOLOGY':{tw}s} {'N':>2s} {'MODE':8s} {'DRAFT':9s} {'k':>2s} {'TOK/S':>7s} "
            f"{'BLOCK ms':>8s} {'WIRE%':>5s}  ")
    indent, last = len(head), width - len(head)
    if last < MIN_LAST_COLUMN:
        indent, last = 4, max(MIN_LAST_COLUMN, width - 4)
    rows = [head + ("PLACEMENT / WHY NOT" if indent > 4 else "")]
    refused = []
    for q in plans:
        if q.topology == SPLIT_SEQUENCE:
            refused = textwrap.wrap(f"{q.topology}: REFUSED: {q.reason.split('. ')[1]}.",
                                    max(MIN_LAST_COLUMN, width))
            continue
        if not q.feasible:
            left = (f"{q.topology:{tw}s} {q.n:>2d} {q.shard_mode:8s} {'':9s} {'':>2s} {'-':>7s} "
                    f"{'':>8s} {'':>5s}  ")
            rows.extend(_wrapped(left, q.reason, last, indent))
            continue
        c = q.cost
        left = (f"{q.topology:{tw}s} {q.n:>2d} {q.shard_mode:8s} {q.proposer:9s} {c.k:>2d} "
                f"{q.tokens_per_s:>7.1f} {c.block_ms:>8.1f} {100 * c.overhead_share:>4.0f}%  ")
        where = ", ".join(f"{r.host}={r.role}" for r in q.placement)
        rows.extend(_wrapped(left, where, last, indent))
    return rows + ([""] + refused if refused else [])


def _wrapped(left: str, text: str, width: int, indent: int) -> list[str]:
    lines = textwrap.wrap(text, width, break_on_hyphens=False) or [""]
    if indent < len(left):  # a narrow terminal: the text under the row
        return [left.rstrip()] + [" " * indent + ln for ln in lines]
    return [left + lines[0]] + [" " * indent + ln for ln in lines[1:]]


def chosen(plans: Sequence):
    """The plan the planner ranks first among the feasible ones (None: none is)."""
    return next((q for q in plans if q.feasible and q.topology != SPLIT_SEQUENCE), None)


def commands(q, model: str) -> list[tuple[str, str]]:
    """(host, command) that build plan q: an agent service per role on each Mac (or `up` where
    one host runs everything), then the `generate` that uses them."""
    out: list[tuple[str, str]] = []
    for r in q.placement:
        m = _SHARD_RE.match(r.role)
        if r.role.startswith("verifier+proposer"):
            out.append((r.host, f"macfleet up --model {model}"))
        elif r.role.startswith("verifier"):
            out.append((r.host, f"macfleet service install --role verifier --model {model}"))
        elif r.role.startswith("proposer"):
            out.append((r.host, f"macfleet service install --role proposer --model {model}"))
        elif m:
            rank, size = int(m.group(1)) - 1, int(m.group(2))
            out.append((r.host, f"macfleet service install --role shard --model {model} "
                        f"--group {SHARD_GROUP} --group-size {size} --rank {rank} "
                        f"--shard-mode {q.shard_mode}"))
    spec = PROPOSER_SPECS.get(q.proposer, q.proposer)
    out.append(("any Mac", "macfleet ls"))
    out.append(("any Mac", f'macfleet generate --model {model} --proposer {spec} "..."'))
    return out
