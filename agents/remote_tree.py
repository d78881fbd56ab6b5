"""N remote proposers : 1 verifier: every proposer's request goes out before any reply is read,
so a block waits for the slowest proposer, not their sum; a failed one is pruned from the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from agents.remote_proposer import RemoteProposer
from macfleet.engine.proposers.group import ProposerGroup
from macfleet.stats import FlowStats


class RemoteProposerGroup(ProposerGroup):
    def __init__(self, proposers: Sequence[RemoteProposer], **kw) -> None:
        super().__init__(proposers, **kw)
        self.failures: list[str] = []

    def _fail(self, j: int, e: Exception) -> None:
        super()._fail(j, e)
        p = self.proposers[j]
        self.failures.append(f"{getattr(p, 'endpoint', p.name)}: {e}")
        p.close()

    def flow_stats(self) -> FlowStats:
        """The proposers draft side by side: per block, the worst of them (blocks summed)."""
        return worst_flows([p.flow_stats() for p in self.remotes])

    @property
    def remotes(self) -> list[RemoteProposer]:
        """Its proposers on other agents."""
        return [p for p in self.proposers if isinstance(p, RemoteProposer)]


def worst_flows(each: Sequence[FlowStats]) -> FlowStats:
    """Field by field the largest per-block figure; remote blocks summed over proposers."""
    if not each:
        return FlowStats()
    out = {f.name: max(getattr(s, f.name) for s in each) for f in fields(FlowStats)}
    out["remote_blocks"] = sum(s.remote_blocks for s in each)
    return FlowStats(**out)
