"""bridge.peers: the endpoints an agent connects to on a request's word (pure parts)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bridge import peers
from bridge.auth import fleet_id
from bridge.card import AgentCard
from bridge.errors import FORBIDDEN, ProtocolError
from bridge.txt import card_from_txt, card_to_txt

KEY = b"p" * 32
OTHER = b"q" * 32


def card(key=KEY, host="10.0.0.5", port=5555) -> AgentCard:
    return AgentCard(node_id="n1", name="mac", fleet_id=fleet_id(key), host=host,
                     router_port=port, pub_port=5556, roles=("proposer",))


def test_a_signed_card_is_a_member_and_survives_its_txt_record():
    c = peers.sign(card(), KEY)
    assert peers.signed(c, KEY)
    props = {k.encode(): v.encode() for k, v in card_to_txt(c).items()}
    back = card_from_txt(props, address=c.host)
    assert peers.signed(back, KEY)
    assert peers.signed_endpoints([back], KEY) == {"tcp://10.0.0.5:5555"}


@pytest.mark.parametrize("forge", [
    lambda c: replace(c, host="10.0.0.66"),  # a member's card copied to another address
    lambda c: replace(c, router_port=22),
    lambda c: replace(c, extra=()),  # no tag: the fleet id alone is public
    lambda c: peers.sign(replace(c, fleet_id=fleet_id(OTHER)), OTHER),  # another fleet's
])
def test_cards_not_signed_by_the_fleet_key_are_not_members(forge):
    assert not peers.signed(forge(peers.sign(card(), KEY)), KEY)


def test_only_members_and_operator_rules_are_allowed():
    members = {"tcp://10.0.0.5:5555"}
    rules = ("tcp://10.0.0.9:7000", "tcp://lab-mac.local:*")
    ok = ["tcp://10.0.0.5:5555", "tcp://10.0.0.9:7000", "tcp://LAB-mac.local:1234"]
    bad = ["tcp://10.0.0.5:5556", "tcp://10.0.0.9:7001", "tcp://169.254.169.254:80",
           "tcp://10.0.0.5:*", "ipc:///tmp/x", "tcp://10.0.0.5:99999", 7]
    for e in ok:
        assert peers.allowed(e, rules, members), e
    for e in bad:
        assert not peers.allowed(e, rules, members), e
    with pytest.raises(ProtocolError) as err:
        peers.check(["tcp://10.0.0.5:5555", "tcp://127.0.0.1:6379"], rules, members)
    assert err.value.code == FORBIDDEN and "6379" in err.value.message
    assert peers.PeerAllowlist(KEY).check([]) is None
    with pytest.raises(ProtocolError):
        peers.PeerAllowlist(KEY).check(["tcp://127.0.0.1:1"])  # nothing allowed by default
    with pytest.raises(ValueError):
        peers.PeerAllowlist(KEY, ("127.0.0.1:80",))


def test_a_young_browser_is_waited_for_then_misses_are_refused_at_once():
    import time

    members: list[AgentCard] = []
    waited = []

    def wait_for(pred, timeout):
        waited.append(timeout)
        members.append(peers.sign(card(), KEY))  # the card arrives meanwhile
        assert pred(members)

    allow = peers.PeerAllowlist(KEY, cards=lambda: members, wait_for=wait_for, settle_s=5.0)
    allow.check(["tcp://10.0.0.5:5555"])
    assert len(waited) == 1 and 0 < waited[0] <= 5.0
    late = peers.PeerAllowlist(KEY, cards=lambda: [], wait_for=wait_for, settle_s=0.0)
    t = time.monotonic()
    with pytest.raises(ProtocolError):
        late.check(["tcp://10.0.0.7:5555"])
    assert len(waited) == 1 and time.monotonic() - t < 0.1
