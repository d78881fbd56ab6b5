"""Ring hostfiles only from authenticated cards: a Zeroconf card is confirmed by the agent it
names, over the fleet's CURVE channel, before a shard ring is built from it."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from agents.daemon import Agent, AgentConfig
from agents.shard_agent import confirm_cards

pytestmark = pytest.mark.timeout(60)

KEY = b"S" * 32
EXTRA = (("group", "g"), ("size", "2"), ("rank", "1"), ("ring_port", "41234"),
         ("mode", "pipeline"), ("phase", "ready"))


class RankAgent(Agent):
    def _card_extra(self):
        return EXTRA


@pytest.fixture(scope="module")
def rank():
    a = RankAgent(AgentConfig(role="verifier", model="tiny:1", key=KEY, advertise=False))
    yield a
    a.close()


def test_a_card_the_agent_confirms_is_accepted(rank):
    assert confirm_cards([rank.card], KEY) == [rank.card]


def test_forged_ring_fields_are_refused(rank):
    forged = replace(rank.card, extra=tuple((k, "6666" if k == "ring_port" else v)
                                            for k, v in EXTRA))
    with pytest.raises(LookupError, match="differs"):
        confirm_cards([forged], KEY)
    with pytest.raises(LookupError, match="differs"):
        confirm_cards([replace(rank.card, node_id="someone-else")], KEY)


def test_cards_pointing_at_non_members_are_refused(rank):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with pytest.raises(LookupError, match="not confirmed"):
        confirm_cards([replace(rank.card, router_port=dead)], KEY, timeout_s=0.25)
    with pytest.raises(LookupError, match="not confirmed"):  # another fleet's key
        confirm_cards([rank.card], b"x" * 32, timeout_s=0.25)
