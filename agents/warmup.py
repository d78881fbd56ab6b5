"""Warm before advertising, so that the first request pays for nothing a later one would not.

A verifier measures (or reads) its verify(L) table, runs each length's first forward and loads
the drafters its `auto` chooses among; a proposer builds and runs once each part of the fleet's
default drafter it serves; a draft-model agent runs its first draft steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

WARM_CONTEXT = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)  # token ids a warm-up draft starts from
WARM_DRAFT = 4


@dataclass(frozen=True)
class Warmed:
    """What an agent did before advertising itself."""

    probed: bool  # measured the verify(L) table now (this machine had none)
    lengths: tuple[int, ...]  # block lengths whose first forward ran
    drafters: tuple[str, ...]  # drafters built and run once
    seconds: float


def warm_verifier(lm) -> Warmed:
    """This machine's verify(L) table for `lm` (probed, or read and each length run once),
    and the drafters `auto` chooses among here, loaded once."""
    from macfleet.engine import verify_costs as vc
    from macfleet.engine.choosing import AUTO_NAME, auto_spec, make_auto_group

    t0 = time.perf_counter()
    had = vc.known_verify_costs(lm.model) is not None
    table = vc.verify_costs(lm.model)
    if had:  # the table came from disk: its shapes have not run in this process yet
        vc.probe_verify_costs(lm.model, sorted(table), reps=0)
    drafters: tuple[str, ...] = ()
    if auto_spec(lm) == AUTO_NAME:
        group = make_auto_group(lm)
        drafters = tuple(p.name for p in group.proposers)
        group.close()
    return Warmed(probed=not had, lengths=tuple(sorted(table)), drafters=drafters,
                  seconds=time.perf_counter() - t0)


def default_parts(lm, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The parts of the fleet's default drafter for `lm` that a proposer serving `kinds`
    builds (`eagle+retrieval+ngram` -> the ones whose kind it serves)."""
    from macfleet.engine.proposers.choice import FLEET, resolve_proposer
    from macfleet.engine.proposers.factory import parse_proposer_spec

    spec, _ = resolve_proposer("auto", lm.spec, FLEET)
    return tuple(p for p in spec.split("+") if parse_proposer_spec(p).kind in kinds)


def warm_proposer(lm, kinds: tuple[str, ...]) -> Warmed:
    """Build and run once each part of the default drafter this proposer serves; one that
    does not build is logged and skipped (its request gets the error)."""
    from macfleet.engine.proposers import ProposerSpecError, make_proposer
    from macfleet.engine.sampling import GREEDY

    t0 = time.perf_counter()
    done = []
    for part in default_parts(lm, kinds):
        try:
            p = make_proposer(part, lm)
        except ProposerSpecError as e:
            log.warning("warm-up: %s does not build here: %s", part, e)
            continue
        if p is None:
            continue
        ctx = [t % lm.vocab_size for t in WARM_CONTEXT]
        try:
            p.start(GREEDY)
            p.propose(ctx, WARM_DRAFT)
        finally:
            p.close()
        done.append(part)
    return Warmed(probed=False, lengths=(), drafters=tuple(done),
                  seconds=time.perf_counter() - t0)


def warm_draft(lm) -> Warmed:
    """A draft-model agent's model (agents/draft_service.py): a prompt's prefill and a few
    draft steps, the shapes its first stream runs."""
    from macfleet.engine.proposers.model_draft import ModelProposer
    from macfleet.engine.sampling import GREEDY

    t0 = time.perf_counter()
    p = ModelProposer(lm.model, name="draft")
    try:
        p.start(GREEDY)
        ctx = [t % lm.vocab_size for t in WARM_CONTEXT]
        for i in range(WARM_DRAFT):  # one token at a time, as the stream drafts
            ctx.append(p.propose(ctx, 1).tokens[0])
    finally:
        p.close()
    return Warmed(probed=False, lengths=(), drafters=(f"draft:{lm.spec}",),
                  seconds=time.perf_counter() - t0)
