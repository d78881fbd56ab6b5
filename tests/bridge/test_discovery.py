"""Discovery over REAL zeroconf on loopback, plus the pure roster.

Nothing leaves the machine: every Zeroconf here is bound to LOOPBACK_ONLY. Registration costs
about 1.2 s of mandatory probing, so advertisers are started concurrently.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import zmq
from zeroconf import IPVersion, Zeroconf

from bridge.card import AgentCard
from bridge.discovery import (
    LOOPBACK_ONLY,
    Advertiser,
    Browser,
    CardAdded,
    CardRemoved,
    CardUpdated,
    DiscoveryEvent,
    Roster,
    instance_name,
    nodes_present,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The machine is shared: other sessions may advertise _macfleet._tcp on lo at the same time, so
# every id here is unique to this run and assertions look only at our own nodes.
RUN = uuid.uuid4().hex[:8]
FLEET = f"fleet-a-{RUN}"
OTHER_FLEET = f"fleet-b-{RUN}"
A1, A2, SUB = f"a1-{RUN}", f"a2-{RUN}", f"sub-{RUN}"
OURS = {A1, A2, SUB}
SHORT = dict(register_timeout_s=5.0, close_timeout_s=2.0)


def make_card(node_id: str, fleet_id: str = FLEET, port: int = 6000, **kw: object) -> AgentCard:
    fields: dict[str, object] = dict(node_id=node_id, name=f"mac-{node_id}", fleet_id=fleet_id,
                                     host="", router_port=port, pub_port=port + 1)
    fields.update(kw)
    return AgentCard(**fields)  # type: ignore[arg-type]


class EventLog:
    """on_change target: records events (from zeroconf's loop thread) and lets tests wait."""

    def __init__(self) -> None:
        self.events: list[DiscoveryEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: DiscoveryEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait(self, match: Callable[[DiscoveryEvent], bool], timeout: float) -> DiscoveryEvent:
        with self._cond:
            assert self._cond.wait_for(lambda: any(map(match, self.events)), timeout), self.events
            return next(e for e in self.events if match(e))


def about(kind: type, node_id: str) -> Callable[[DiscoveryEvent], bool]:
    return lambda e: isinstance(e, kind) and e.card.node_id == node_id


@pytest.fixture
def subprocess_advertiser() -> Iterator[Callable[..., subprocess.Popen]]:
    procs: list[subprocess.Popen] = []

    def start(node_id: str, fleet_id: str, port: int) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "advertise_helper.py"), node_id, fleet_id, str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.mark.slow  # starts an advertiser process
@pytest.mark.timeout(30)
def test_real_zeroconf_on_loopback(subprocess_advertiser: Callable[..., subprocess.Popen]) -> None:
    fleet_log, all_log = EventLog(), EventLog()
    shared = Zeroconf(interfaces=list(LOOPBACK_ONLY), ip_version=IPVersion.V4Only,
                      use_asyncio=False)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    fleet_browser = Browser(fleet_id=FLEET, interfaces=LOOPBACK_ONLY, on_change=fleet_log,
                            resolve_timeout_s=2.0)
    # The unfiltered browser borrows a Zeroconf that an advertiser shares too.
    all_browser = Browser(interfaces=LOOPBACK_ONLY, on_change=all_log, zeroconf=shared,
                          resolve_timeout_s=2.0)
    advertisers: list[Advertiser] = []
    try:
        proc = subprocess_advertiser(SUB, FLEET, 7000)
        with ThreadPoolExecutor(2) as pool:  # probing takes ~1.2 s each: do it concurrently
            a1_future = pool.submit(Advertiser, make_card(A1, port=port),
                                    interfaces=LOOPBACK_ONLY, **SHORT)
            a2_future = pool.submit(Advertiser, make_card(A2, OTHER_FLEET, port=6100),
                                    interfaces=LOOPBACK_ONLY, zeroconf=shared, **SHORT)
            a1, a2 = a1_future.result(10), a2_future.result(10)
        advertisers += [a1, a2]
        ready = proc.stdout.readline().split() if proc.stdout else []
        assert ready[:1] == ["ready"], ready

        # Both browsers see the in-process and the subprocess advertisers; the filter holds.
        everyone = all_browser.wait_for(nodes_present(A1, A2, SUB), timeout=5)
        assert {c.node_id: c.fleet_id for c in everyone if c.node_id in OURS} == \
            {A1: FLEET, A2: OTHER_FLEET, SUB: FLEET}
        fleet = fleet_browser.wait_for(nodes_present(A1, SUB), timeout=5)
        assert sorted(c.node_id for c in fleet) == sorted([A1, SUB])  # fleet ids are ours alone
        assert not any(e.card.fleet_id != FLEET for e in fleet_log.events)

        # The resolved address is the loopback one, and it is connectable as is.
        card = next(c for c in fleet if c.node_id == A1)
        assert card == a1.card and card.host == "127.0.0.1"
        assert a1.service_name == f"{instance_name(card)}._macfleet._tcp.local."
        with ctx.socket(zmq.DEALER) as dealer:
            dealer.linger = 0
            dealer.connect(card.router_endpoint)
            dealer.send(b"hello")
            assert router.poll(2000), "nothing arrived at the advertised endpoint"
            assert router.recv_multipart()[1] == b"hello"

        # An update is re-announced and seen; an unchanged card is not re-announced.
        newer = replace(a1.card, mem_free=42 * 2**30, models=("smollm2-135m",))
        assert a1.update(newer)
        assert not a1.update(newer)
        with pytest.raises(ValueError, match="node id"):
            a1.update(replace(newer, node_id="someone-else"))
        updated = fleet_log.wait(about(CardUpdated, A1), timeout=3)
        assert isinstance(updated, CardUpdated)
        assert updated.card.models == ("smollm2-135m",) and updated.previous == card
        first_seen = {s.card.node_id: s for s in fleet_browser.sightings()}[A1]
        assert first_seen.first_seen < first_seen.last_seen

        # A clean close sends goodbyes: both browsers drop the card within about a second.
        started = time.monotonic()
        a1.close()
        fleet_log.wait(about(CardRemoved, A1), timeout=3)
        all_log.wait(about(CardRemoved, A1), timeout=3)
        assert time.monotonic() - started < 3

        # SIGKILL: no goodbye, so zeroconf keeps listing the agent (PTR TTL is 75 min).
        # Liveness has to come from heartbeats; this is the behaviour we document, not a bug.
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        time.sleep(2.5)
        assert SUB in {c.node_id for c in fleet_browser.cards()}
        assert not any(about(CardRemoved, SUB)(e) for e in fleet_log.events)

        # A timeout names what was seen.
        with pytest.raises(TimeoutError, match=rf"sub-{SUB}\({SUB}\)@127\.0\.0\.1"):
            fleet_browser.wait_for(nodes_present("ghost"), timeout=0.2)
        assert [type(e) for e in fleet_log.events if e.card.node_id == A1] == \
            [CardAdded, CardUpdated, CardRemoved]
    finally:
        for advertiser in advertisers:
            advertiser.close()
        fleet_browser.close()
        all_browser.close()
        shared.close()
        router.close(linger=0)
        ctx.destroy(linger=0)


@pytest.mark.timeout(10)
def test_registration_has_a_deadline() -> None:
    with pytest.raises(TimeoutError, match="registering"):
        Advertiser(make_card(f"slow-{RUN}"), interfaces=LOOPBACK_ONLY, register_timeout_s=0.05)


# -- pure roster -------------------------------------------------------------------------------
def test_roster_keys_by_node_id_across_service_names() -> None:
    roster = Roster(fleet_id=FLEET)
    card = make_card("n1")
    assert roster.observe("old", card, 1.0) == [CardAdded(card, 1.0)]
    assert roster.observe("old", card, 2.0) == []  # re-announcement of the same card
    moved = replace(card, router_port=7000)
    assert roster.observe("new", moved, 3.0) == [CardUpdated(moved, card, 3.0)]
    assert roster.forget("old", 4.0) == []  # a stale name expiring does not remove the node
    (sighting,) = roster.sightings()
    assert (sighting.service, sighting.first_seen, sighting.last_seen) == ("new", 1.0, 3.0)
    assert roster.forget("new", 5.0) == [CardRemoved(moved, 5.0)]
    assert roster.cards() == []


def test_roster_filters_fleet_and_follows_a_card_leaving_it() -> None:
    roster = Roster(fleet_id=FLEET)
    assert roster.observe("s", make_card("x", OTHER_FLEET), 1.0) == []
    card = make_card("n1")
    roster.observe("s", card, 2.0)
    assert roster.observe("s", replace(card, fleet_id=OTHER_FLEET), 3.0) == \
        [CardRemoved(card, 3.0)]
    other = make_card("n2")
    roster.observe("t", card, 4.0)
    assert roster.observe("t", other, 5.0) == [CardRemoved(card, 5.0), CardAdded(other, 5.0)]


def test_instance_name_is_one_label_and_keeps_the_node_id() -> None:
    card = make_card("0123456789abcdef0123456789abcdef", name="Mac Studio (bureau) " * 5)
    name = instance_name(card)
    assert len(name.encode()) <= 63 and name.endswith(card.node_id) and "." not in name
