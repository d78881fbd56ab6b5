"""Zeroconf (DNS-SD) discovery: agents advertise their card, clients browse for cards.

Threading: each Advertiser / Browser owns a ``Zeroconf(use_asyncio=False)``, so python-zeroconf
runs its own loop in its own thread, and we drive its ``async_*`` API on that loop from the
caller's thread with ``run_coroutine_threadsafe(...).result(deadline)``. Not the sync wrappers:
their deadlines are fixed in the library (plus 10 s of slack) and ``unregister_service`` returns
before the goodbyes are sent, so a close right after it can drop them. Not a loop of our own:
zeroconf already has one. ``use_asyncio=False`` because inside a running loop (Textual, an
asyncio agent) zeroconf would attach to *that* loop and our blocking calls would deadlock it.
Blocking calls from zeroconf's loop thread (an ``on_change`` callback) raise RuntimeError.

Liveness is NOT decided here. A clean ``Advertiser.close()`` sends goodbyes and browsers report
``CardRemoved`` at once, but a SIGKILLed or unplugged agent sends nothing: its records stay in
every cache for their TTL (75 min for the PTR record) and browsers keep listing it. A card means
"this agent announced itself", not "it is up": use ``bridge.heartbeat`` for liveness.

Loopback: ``interfaces=LOOPBACK_ONLY`` keeps multicast on ``lo`` (works on Linux although ``lo``
lacks the MULTICAST flag). Browsers resolve exactly the address the advertiser put in its A
record: the card's host, else the first IPv4 of ``interfaces`` (127.0.0.1 for LOOPBACK_ONLY),
else the default-route IPv4. ``ALL_INTERFACES`` includes ``lo`` on Linux, so a production browser
on the same machine also sees loopback test agents: filter by fleet id.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

from zeroconf import InterfaceChoice, IPVersion, ServiceInfo, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

from bridge.card import SERVICE_TYPE, AgentCard
from bridge.peers import resign_after_s, sign, stamp_of
from bridge.roster import (CardAdded, CardRemoved, CardUpdated, DiscoveryEvent, Roster,
                           Sighting, nodes_present)
from bridge.txt import (
    TxtProtocolError,
    TxtRecordError,
    card_from_txt,
    card_to_txt,
    instance_name,
    pick_address,
    server_name,
)

log = logging.getLogger(__name__)

# the roster's events are part of this module's interface (Browser's on_change receives them)
__all__ = ["ALL_INTERFACES", "LOOPBACK_ONLY", "Advertiser", "Browser", "CardAdded", "CardRemoved",
           "CardUpdated", "DiscoveryEvent", "Roster", "Sighting", "advertised_host",
           "nodes_present"]

# Probing (3 queries, 500 ms apart after a 150-250 ms random delay) is most of a registration.
DEFAULT_REGISTER_TIMEOUT_S = 10.0
DEFAULT_UPDATE_TIMEOUT_S = 5.0
DEFAULT_CLOSE_TIMEOUT_S = 3.0  # goodbyes go out three times, 125 ms apart
DEFAULT_RESOLVE_TIMEOUT_S = 3.0
DEFAULT_START_TIMEOUT_S = 5.0
DEFAULT_WAIT_TIMEOUT_S = 10.0

LOOPBACK_ONLY: tuple[str, ...] = ("127.0.0.1",)  # tests and single-machine fleets
ALL_INTERFACES = InterfaceChoice.All
Interfaces = Sequence[str] | InterfaceChoice

_UNSPECIFIED_HOSTS = frozenset({"", "0.0.0.0", "*"})
T = TypeVar("T")


# -- the zeroconf handle -----------------------------------------------------------------------
class _Zc:
    """A Zeroconf we own (closed with us) or borrow, and blocking calls onto its loop."""

    def __init__(self, interfaces: Interfaces, zeroconf: Zeroconf | None) -> None:
        self.owned = zeroconf is None
        if zeroconf is None:
            ifaces = interfaces if isinstance(interfaces, InterfaceChoice) else list(interfaces)
            zeroconf = Zeroconf(interfaces=ifaces, ip_version=IPVersion.V4Only, use_asyncio=False)
        self.zc = zeroconf
        assert zeroconf.loop is not None
        self.loop = zeroconf.loop

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        """Run ``coro`` on zeroconf's loop; TimeoutError naming ``what`` after ``timeout_s``."""
        if _on_loop(self.loop):
            coro.close()
            raise RuntimeError(f"{what}: blocking call from zeroconf's own loop thread")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError as exc:
            future.cancel()
            raise TimeoutError(f"{what} did not finish within {timeout_s:.1f} s") from exc

    def close(self) -> None:
        if self.owned:
            self.zc.close()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop running in this thread
        return False


# -- advertiser --------------------------------------------------------------------------------
def _default_route_ipv4() -> str:
    """The address this machine would use to reach the mDNS group; connect() on UDP sends no
    packet. Falls back to loopback on a machine with no route (it can only reach itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("224.0.0.251", 5353))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def advertised_host(card: AgentCard, interfaces: Interfaces) -> str:
    """The IPv4 address to put in the A record: the card's own, else the first of
    ``interfaces``, else the default-route address. Hostnames are refused: an A record needs an
    address, and clients connect to ``card.host`` as given."""
    if card.host not in _UNSPECIFIED_HOSTS:
        if ipaddress.ip_address(card.host).version != 4:  # ValueError for a hostname
            raise ValueError(f"card.host {card.host!r}: only IPv4 is advertised")
        return card.host
    if not isinstance(interfaces, InterfaceChoice):
        for iface in interfaces:
            try:
                if ipaddress.ip_address(iface).version == 4:
                    return iface
            except ValueError:
                continue  # an interface index or name, not an address
    return _default_route_ipv4()


class Advertiser:
    """Registers one agent's card as ``<instance>._macfleet._tcp.local.`` until closed.

    Construction probes for a unique name (renaming ``-2``... on a conflict) and returns once the
    service is registered; announcements go on in the background. ``update`` re-announces only
    when the advertised records change: quantize fast-moving fields (free memory) before calling
    it, mDNS is a shared medium.
    """

    def __init__(
        self,
        card: AgentCard,
        *,
        interfaces: Interfaces = ALL_INTERFACES,
        zeroconf: Zeroconf | None = None,
        register_timeout_s: float = DEFAULT_REGISTER_TIMEOUT_S,
        update_timeout_s: float = DEFAULT_UPDATE_TIMEOUT_S,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
        key: bytes | None = None,
    ) -> None:
        """key: the fleet key; the card is advertised with its tag (`bridge.peers.sign`) for
        the host it is advertised at and the time, so other agents may connect to it on a
        request's word; `update` re-signs it once the tag is `resign_after_s` old."""
        self._interfaces = interfaces
        self._update_timeout_s = update_timeout_s
        self._close_timeout_s = close_timeout_s
        self._key = key
        self._card = sign(replace(card, host=advertised_host(card, interfaces)), key)
        self._info = self._service_info(self._card, f"{instance_name(card)}.{SERVICE_TYPE}")
        self._announce: asyncio.Future[None] | None = None
        self._closed = False
        self._zc = _Zc(interfaces, zeroconf)
        try:
            self._zc.run(self._async_register(), register_timeout_s,
                         f"registering {self._info.name}")
        except BaseException:  # cleanup, then re-raise: a failed constructor leaks no sockets
            self._zc.close()
            raise
        log.info("advertising %s at %s", self._info.name, self._card.router_endpoint)

    @property
    def card(self) -> AgentCard:
        """The card as advertised, with the host browsers will resolve."""
        return self._card

    @property
    def service_name(self) -> str:
        """The registered instance name (may carry a ``-2`` suffix after a conflict)."""
        return self._info.name

    def _service_info(self, card: AgentCard, name: str) -> ServiceInfo:
        return ServiceInfo(SERVICE_TYPE, name, port=card.router_port, server=server_name(card),
                           properties=card_to_txt(card), parsed_addresses=[card.host])

    async def _async_register(self) -> None:
        zc = self._zc.zc
        self._announce = await zc.async_register_service(self._info, allow_name_change=True)

    async def _async_update(self, info: ServiceInfo) -> None:
        self._cancel_announce()  # an older announcement series would re-send stale records
        self._announce = await self._zc.zc.async_update_service(info)

    async def _async_unregister(self) -> None:
        self._cancel_announce()
        goodbyes = await self._zc.zc.async_unregister_service(self._info)
        await goodbyes

    def _cancel_announce(self) -> None:
        if self._announce is not None and not self._announce.done():
            self._announce.cancel()
        self._announce = None

    def update(self, card: AgentCard) -> bool:
        """Re-announce ``card`` if its advertised records differ; returns whether it did."""
        if self._closed:
            raise RuntimeError("advertiser is closed")
        if card.node_id != self._card.node_id:
            raise ValueError(f"update changes node id {self._card.node_id} -> {card.node_id}")
        stamp = stamp_of(self._card)
        if stamp is not None and time.time() - stamp >= resign_after_s():
            stamp = None  # a fresh tag, before the old one goes stale
        card = sign(replace(card, host=advertised_host(card, self._interfaces)), self._key,
                    stamp)
        info = self._service_info(card, self._info.name)
        if (info.text, info.port, info.addresses) == (self._info.text, self._info.port,
                                                      self._info.addresses):
            self._card = card
            return False
        self._zc.run(self._async_update(info), self._update_timeout_s, f"updating {info.name}")
        self._info, self._card = info, card
        return True

    def close(self) -> None:
        """Unregister and wait until the goodbyes are sent, then release zeroconf. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._zc.run(self._async_unregister(), self._close_timeout_s,
                         f"unregistering {self._info.name}")
        finally:
            self._zc.close()
        log.info("withdrew %s", self._info.name)

    def __enter__(self) -> Advertiser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- browser -----------------------------------------------------------------------------------
class Browser:
    """Browses ``_macfleet._tcp`` and keeps the cards of one fleet (or all, ``fleet_id=None``).

    ``on_change(event)`` runs on zeroconf's loop thread: it must be quick and must not call
    blocking methods of an Advertiser or Browser (post the event to your own thread instead).
    Records that fail to parse or speak another protocol are logged once per service and
    skipped; so are cards ``accept`` refuses (agents and clients pass `bridge.peers.signed`
    under their key: a replayed or forged card never enters the roster, so it can neither be
    connected to nor displace the card of the member whose node id it copies).
    """

    def __init__(
        self,
        *,
        fleet_id: str | None = None,
        interfaces: Interfaces = ALL_INTERFACES,
        on_change: Callable[[DiscoveryEvent], None] | None = None,
        zeroconf: Zeroconf | None = None,
        resolve_timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        accept: Callable[[AgentCard], bool] | None = None,
    ) -> None:
        self._on_change = on_change
        self._accept = accept
        self._resolve_timeout_ms = int(resolve_timeout_s * 1000)
        self._close_timeout_s = close_timeout_s
        self._clock = clock
        self._roster = Roster(fleet_id)
        self._cond = threading.Condition()
        self._generation: dict[str, int] = {}  # service -> latest request; older answers drop
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned: set[tuple[str, str]] = set()
        self._browser: AsyncServiceBrowser | None = None
        self._closed = False
        self._zc = _Zc(interfaces, zeroconf)
        try:
            self._zc.run(self._async_start(), start_timeout_s, "starting the browser")
        except BaseException:  # cleanup, then re-raise
            self._zc.close()
            raise

    async def _async_start(self) -> None:
        self._browser = AsyncServiceBrowser(self._zc.zc, SERVICE_TYPE, handlers=[self._on_state])

    # -- on zeroconf's loop ----------------------------------------------------------------
    def _on_state(self, zeroconf: Zeroconf, service_type: str, name: str,
                  state_change: ServiceStateChange) -> None:
        generation = self._generation[name] = self._generation.get(name, 0) + 1
        if state_change is ServiceStateChange.Removed:
            self._apply(lambda now: self._roster.forget(name, now))
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name, generation))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("resolving a service failed", exc_info=task.exception())

    async def _resolve(self, name: str, generation: int) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        found = await info.async_request(self._zc.zc, self._resolve_timeout_ms)
        if self._generation.get(name) != generation:
            return  # removed or updated meanwhile; the newer request decides
        if not found:
            log.warning("%s did not resolve within %d ms", name, self._resolve_timeout_ms)
            return
        try:
            address = pick_address(info.parsed_addresses(IPVersion.V4Only))
            card = card_from_txt(info.properties, address=address)
        except TxtRecordError as exc:
            level = logging.INFO if isinstance(exc, TxtProtocolError) else logging.WARNING
            self._skip(name, str(exc), level)
            return
        if self._accept is not None and not self._accept(card):
            if self._roster.keeps(card):
                self._skip(name, f"its tag does not check (a forged, replayed or stale card "
                                 f"for {card.router_endpoint})", logging.WARNING)
            return
        self._apply(lambda now: self._roster.observe(name, card, now))

    def _skip(self, name: str, why: str, level: int) -> None:
        if (name, why) not in self._warned:
            self._warned.add((name, why))
            log.log(level, "skipping %s: %s", name, why)
        self._apply(lambda now: self._roster.forget(name, now))

    def _apply(self, change: Callable[[float], list[DiscoveryEvent]]) -> None:
        with self._cond:
            events = change(self._clock())
            if events:
                self._cond.notify_all()
        for event in events:
            log.debug("discovery: %s", event)
            if self._on_change is not None:
                try:
                    self._on_change(event)
                except Exception:  # noqa: BLE001 - must not break zeroconf's loop; logged
                    log.exception("on_change callback failed on %s", type(event).__name__)

    # -- any thread ------------------------------------------------------------------------
    def cards(self) -> list[AgentCard]:
        with self._cond:
            return self._roster.cards()

    def sightings(self) -> list[Sighting]:
        with self._cond:
            return self._roster.sightings()

    def wait_for(self, predicate: Callable[[list[AgentCard]], bool],
                 timeout: float = DEFAULT_WAIT_TIMEOUT_S) -> list[AgentCard]:
        """Block until ``predicate(cards)`` holds; returns those cards. Raises TimeoutError
        naming the cards seen when ``timeout`` seconds pass first."""
        with self._cond:
            if self._cond.wait_for(lambda: predicate(self._roster.cards()), timeout):
                return self._roster.cards()
            seen = ", ".join(f"{c.name or '?'}({c.node_id})@{c.host}" for c in self._roster.cards())
        raise TimeoutError(f"discovery: condition not met within {timeout:.1f} s; "
                           f"saw {seen or 'no agents'}")

    async def _async_close(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop browsing and cancel pending resolutions, then release zeroconf. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._zc.run(self._async_close(), self._close_timeout_s, "closing the browser")
        finally:
            self._zc.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
