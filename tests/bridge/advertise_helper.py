"""Run one Advertiser in its own process for the discovery tests.

Usage: python3 advertise_helper.py NODE_ID FLEET_ID ROUTER_PORT
Prints ``ready <service name>`` once registered, then waits for stdin to close (clean exit with
goodbyes) or for a signal (SIGKILL: no goodbye, which is what the test is about).
"""

from __future__ import annotations

import sys

from bridge.card import AgentCard
from bridge.discovery import LOOPBACK_ONLY, Advertiser


def main() -> None:
    node_id, fleet_id, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    card = AgentCard(node_id=node_id, name=f"sub-{node_id}", fleet_id=fleet_id, host="",
                     router_port=port, pub_port=port + 1, roles=("proposer",))
    with Advertiser(card, interfaces=LOOPBACK_ONLY) as advertiser:
        print("ready", advertiser.service_name, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
