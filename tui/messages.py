"""Messages posted from the snapshot worker thread to the dashboard app."""

from __future__ import annotations

from textual.message import Message

from macfleet.fleet.snapshot import FleetSnapshot


class SnapshotArrived(Message):
    """A new fleet snapshot came out of the source (posted from the poll worker)."""

    def __init__(self, snapshot: FleetSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot
