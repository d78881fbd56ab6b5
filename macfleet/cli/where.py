"""Where a `generate` (or `serve`) runs and why: one line on stderr, and `stats.where` in
`generate --json`. Pure constructors; the commands print."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FLEET, IN_PROCESS = "fleet", "in-process"
LOCAL_ASKED = "--local"


@dataclass(frozen=True)
class Where:
    mode: str  # FLEET | IN_PROCESS
    why: str  # for people: what was looked for, what was found
    fleet_id: str = ""
    verifier: str = ""  # agent name
    verifier_host: str = ""
    proposers: tuple[str, ...] = ()  # agent names
    waited: bool = False  # looked for agents first (`--local` skips that)

    def line(self, prog: str = "macfleet", running: str = "running") -> str:
        if self.mode == FLEET:
            props = ", ".join(self.proposers) or "none (the verifier drafts for itself)"
            return (f"{prog}: fleet {self.fleet_id}: verifier {self.verifier} "
                    f"({self.verifier_host}), proposers {props}")
        if self.why == LOCAL_ASKED:
            return f"{prog}: {running} in-process ({LOCAL_ASKED})"
        tail = "; `--local` skips the wait" if self.waited else ""
        return f"{prog}: {self.why}: {running} in-process{tail}"

    def to_dict(self) -> dict:
        return {"mode": self.mode, "why": self.why, "fleet_id": self.fleet_id or None,
                "verifier": self.verifier or None, "verifier_host": self.verifier_host or None,
                "proposers": list(self.proposers)}


def asked_local() -> Where:
    return Where(IN_PROCESS, LOCAL_ASKED)


def no_key(path: str) -> Where:
    return Where(IN_PROCESS, f"no fleet key at {path} (`macfleet keygen` makes one, "
                 "`macfleet key import` takes your fleet's)")


def no_fleet(fleet_id: str, wait_s: float, seen: int, why: str) -> Where:
    """No usable verifier: none seen at all within wait_s, or `why` (NoFleet's message)."""
    if not seen:
        why = f"no agents in fleet {fleet_id} after {wait_s:.1f} s"
    return Where(IN_PROCESS, why, fleet_id=fleet_id, waited=True)


def in_fleet(fleet_id: str, verifier, proposers: Sequence) -> Where:
    """verifier, proposers: the AgentCards chosen (fleet/client.py `Placed`)."""
    return Where(FLEET, "a live verifier for the model", fleet_id=fleet_id, verifier=verifier.name,
                 verifier_host=verifier.host, proposers=tuple(p.name for p in proposers))
