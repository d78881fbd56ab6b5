"""A fleet client to run inside a test-bed namespace (`ip netns exec NS python fleet_client.py`).

    discover --key K --expect N          -> one JSON line: the cards seen (all interfaces)
    discover --key K --role R            -> the same, once a card carries role R (or --wait ends)
    generate --key K --expect N ...      -> JSON lines: {"chunk": ids} ..., then {"done": ids, ...}
                                            or {"error": why} (exit status 3)

The test reads the lines as they come, so it can act (cut a link) mid-generation.
"""

from __future__ import annotations

import argparse
import json
import sys

from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
from bridge.discovery import ALL_INTERFACES, Browser
from bridge.errors import PeerUnavailable, ProtocolError, TransportTimeout
from bridge.messages import GenerateChunk, GenerateDone
from bridge.peers import signed
from macfleet.engine.controller import AUTO, parse_draft_tokens
from macfleet.fleet.client import fleet_id, generate_remote, members
from macfleet.fleet.keys import load_key


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("discover", "generate"))
    p.add_argument("--key", required=True)
    p.add_argument("--expect", type=int, default=2)
    p.add_argument("--wait", type=float, default=20.0)
    p.add_argument("--role", help="discover: wait for a card with this role (a sharded "
                                  "verifier's rank 0 takes `verifier` once its ring is up)")
    p.add_argument("--prompt", default="the cat sat on the mat and the dog sat on the rug")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--spec", default="ngram")
    p.add_argument("--alone", action="store_true", help="no proposer: the verifier alone")
    p.add_argument("--draft-tokens", type=parse_draft_tokens, default=AUTO)
    a = p.parse_args()
    key = load_key(a.key)
    if a.role:  # one browser watching, not a client process per look
        with Browser(fleet_id=fleet_id(key), interfaces=ALL_INTERFACES,
                     accept=lambda c: signed(c, key)) as b:
            try:
                cards = b.wait_for(lambda cs: any(a.role in c.roles for c in cs), a.wait)
            except TimeoutError:
                cards = b.cards()
    else:
        cards = members(key, wait_s=a.wait, expect=a.expect)
    if a.what == "discover":
        print(json.dumps([{"name": c.name, "host": c.host, "roles": list(c.roles),
                           "router": c.router_endpoint} for c in cards]), flush=True)
        return 0
    v = next(c for c in cards if ROLE_VERIFIER in c.roles)
    props = [] if a.alone else [c.router_endpoint for c in cards if ROLE_PROPOSER in c.roles]
    try:
        for msg in generate_remote(v, key, prompt=a.prompt, chat=False,
                                   max_tokens=a.max_tokens, proposers=props,
                                   proposer_spec=a.spec if props else "none",
                                   draft_tokens=a.draft_tokens, first_token_timeout_s=60):
            if isinstance(msg, GenerateChunk):
                print(json.dumps({"chunk": msg.token_ids}), flush=True)
            elif isinstance(msg, GenerateDone):
                print(json.dumps({"done": msg.token_ids, "stats": msg.stats.to_dict()}), flush=True)
    except (TransportTimeout, PeerUnavailable, ProtocolError) as e:  # a clear error, as a line
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
