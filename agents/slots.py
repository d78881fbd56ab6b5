"""Who gets a drafting session of a proposer agent when its slots run out (pure; `limits` is
agents/proposer_service.py's ProposerLimits).
"""

from __future__ import annotations

from dataclasses import dataclass


def reclaimable(last_used: dict[str, float], now: float, min_idle_s: float) -> str | None:
    """The session idle longest, when it has been idle at least min_idle_s (pure)."""
    if not last_used:
        return None
    sid = min(last_used, key=last_used.__getitem__)
    return sid if now - last_used[sid] >= min_idle_s else None


@dataclass(frozen=True)
class Slot:
    """Whether a client may open one more session, and which session gives way for it."""

    ok: bool
    evict: str | None = None
    why: str = ""


def slot_for(peer: bytes, owners: dict[str, bytes], last_used: dict[str, float], now: float,
             limits) -> Slot:
    """A new session for client `peer` (pure): admitted under the per-client cap and the total;
    when every slot is taken, the session idle `reclaim_idle_s` gives way, else (fair share) the
    least recently used one of the client holding the most, when it holds more than `peer` would
    (docs/agents.md, "slots.py")."""
    mine = sum(1 for o in owners.values() if o == peer)
    if mine >= limits.max_sessions_per_client:
        return Slot(False, why=f"this client holds {mine} drafting sessions (the limit per "
                               "client); close one first")
    if len(owners) < limits.max_sessions:
        return Slot(True)
    idle = reclaimable(last_used, now, limits.reclaim_idle_s)
    if idle is not None:
        return Slot(True, idle)
    held: dict[bytes, list[str]] = {}
    for sid, o in owners.items():
        held.setdefault(o, []).append(sid)
    top = max(held.values(), key=len)
    if len(top) > mine + 1:
        return Slot(True, min(top, key=lambda sid: last_used.get(sid, 0.0)))
    return Slot(False, why=f"{len(owners)} sessions open (the limit), all of them active and "
                           "shared fairly")
