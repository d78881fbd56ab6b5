"""The shard watchdog: a blocked call past its deadline fires (the cut-link case), fast."""

from __future__ import annotations

import threading
import time

import pytest

from agents.shard import ShardPeerLost, Watchdog


def test_fires_on_a_blocked_call_and_not_on_a_quick_one():
    fired: list[str] = []
    done = threading.Event()
    wd = Watchdog(0.2, lambda what: (fired.append(what), done.set()))
    try:
        with wd.guard("quick"):
            pass
        time.sleep(0.3)
        assert fired == []
        t = time.monotonic()
        with wd.guard("all_sum over a cut link"):
            assert done.wait(2.0)  # stands in for a collective that never returns
        assert fired == ["all_sum over a cut link"]
        assert 0.15 < time.monotonic() - t < 1.0
    finally:
        wd.close()


def test_a_ring_error_becomes_shard_peer_lost():
    wd = Watchdog(5.0, lambda what: None)
    try:
        with pytest.raises(ShardPeerLost, match="connection to a peer was lost"):
            with wd.guard("all_sum"):
                raise RuntimeError("[ring] connection to a peer was lost")
    finally:
        wd.close()
