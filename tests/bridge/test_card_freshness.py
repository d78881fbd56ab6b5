"""Card tags are fresh and bound to their endpoint (issue 47): a recorded card replayed after
its tag's life fails `bridge.peers.signed`; advertisers re-sign in time; a browser that checks
tags (agents' and clients') drops a replayed card before it can displace the genuine one."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

import pytest

from bridge import discovery, peers
from bridge.auth import fleet_id
from bridge.card import AgentCard
from bridge.discovery import LOOPBACK_ONLY, Advertiser, Browser

KEY = b"f" * 32
RUN = uuid.uuid4().hex[:6]


def card(node: str = "n1", port: int = 5555) -> AgentCard:
    return AgentCard(node_id=node, name="mac", fleet_id=fleet_id(KEY), host="127.0.0.1",
                     router_port=port, pub_port=port + 1, roles=("proposer",))


def test_a_tag_holds_for_its_life_and_the_clock_skew_only():
    now = 1_800_000_000
    life, skew = peers.DEFAULT_CARD_MAX_AGE_S, peers.DEFAULT_CLOCK_SKEW_S
    c = peers.sign(card(), KEY, stamp=now)
    assert peers.signed(c, KEY, now=now) and peers.signed(c, KEY, now=now + life + skew)
    assert not peers.signed(c, KEY, now=now + life + skew + 1)  # replayed too late
    assert peers.signed(c, KEY, now=now - skew) and not peers.signed(c, KEY, now=now - skew - 1)
    later = dict(c.extra) | {"ts": str(now + 60)}  # a newer stamp under the old tag
    assert not peers.signed(replace(c, extra=tuple(later.items())), KEY, now=now + 60)
    assert not peers.signed(replace(c, extra=(("sig", dict(c.extra)["sig"]),)), KEY, now=now)
    assert not peers.signed(replace(c, router_port=6000), KEY, now=now)  # another port


class Clock:
    """The time module with its wall clock moved forward by `ahead` seconds: the tag's life
    passes without the test sleeping through it (stamps and re-sign ages read time.time())."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def time(self) -> float:
        return time.time() + self.ahead

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.mark.slow  # real Zeroconf: an advertiser's probes and goodbyes take seconds
def test_an_advertiser_re_signs_before_its_tag_goes_stale(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(discovery, "time", clock)
    monkeypatch.setattr(peers, "time", clock)
    adv = Advertiser(card(f"fresh-{RUN}"), interfaces=LOOPBACK_ONLY, key=KEY)
    try:
        first = peers.stamp_of(adv.card)
        assert not adv.update(adv.card)  # nothing changed, the tag is young: no re-announce
        clock.ahead = first + peers.resign_after_s() - 0.5 - time.time()
        assert not adv.update(adv.card)  # just short of a third of its life
        clock.ahead += 0.55  # a third of its life
        assert adv.update(adv.card) and peers.stamp_of(adv.card) > first
        assert peers.signed(adv.card, KEY)
    finally:
        adv.close()


@pytest.mark.slow  # real Zeroconf: two advertisers and a browser, 3.4 s on an idle box
def test_a_checking_browser_drops_a_replayed_card_and_keeps_the_member():
    genuine = card(f"member-{RUN}", port=41000)
    decided = threading.Event()

    def accept(c: AgentCard) -> bool:
        ok = peers.signed(c, KEY)
        if c.router_port == 41999:
            decided.set()
        return ok

    with Browser(fleet_id=fleet_id(KEY), interfaces=LOOPBACK_ONLY, accept=accept) as b, \
            Advertiser(genuine, interfaces=LOOPBACK_ONLY, key=KEY) as adv:
        b.wait_for(lambda cs: any(c.node_id == genuine.node_id for c in cs), 10)
        # the member's card with its real tag, at another port, under the same node id
        with Advertiser(replace(adv.card, name="replayed", router_port=41999),
                        interfaces=LOOPBACK_ONLY):
            assert decided.wait(10), "the browser never resolved the replayed card"
            # accepted, it would be in the roster as soon as `accept` returned (same task)
            with pytest.raises(TimeoutError):
                b.wait_for(lambda cs: any(c.router_port == 41999 for c in cs), 0.5)
            cards = [c for c in b.cards() if c.node_id == genuine.node_id]
            assert [c.router_port for c in cards] == [41000], cards


def test_open_fleet_cards_need_no_tag_and_closed_ones_are_no_open_members():
    open_card = replace(card(), fleet_id=fleet_id(None))
    assert peers.signed(peers.sign(open_card, None), None)
    assert not peers.signed(peers.sign(card(), KEY), None)
