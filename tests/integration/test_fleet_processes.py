"""A real 2-agent fleet: separate processes, Zeroconf on loopback, ZeroMQ, a tiny model.

One fleet per module; the test that kills the proposer runs last. The processes, discovery and
the wire are under test, not the model: a tiny one (4 layers, a character tokenizer) takes
milliseconds a generation where smollm2 took seconds. The embedded model through a fleet:
tests/serve/test_clients.py's `up --serve` (a named call equal to `serve --local`'s).

Token ids: the "greedy margin" rule of tests/tolerance.py for drafting vs the verifier
alone; "same path" for a seeded request asked twice of the same agents, drafting fixed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bridge.auth import fleet_id
from bridge.card import ROLE_PROPOSER, ROLE_VERIFIER
from bridge.discovery import LOOPBACK_ONLY, Browser
from bridge.errors import FORBIDDEN, PeerUnavailable, ProtocolError
from bridge.messages import GenerateChunk, GenerateDone, Ping, Pong, StatusReply, StatusRequest
from bridge.transport import Client
from fleetkit import local_fleet
from macfleet.fleet.client import generate_remote, probe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny:1"
LAYERSKIP = "layerskip:2"  # of the tiny model's 4 layers
TRIES = 5  # generations that may end before the proposer's session opens (see _remote)

PROMPTS = [
    "Summarize, reusing its wording: the cat sat on the mat, and the dog sat on the rug.",
    "Write a Python function that adds two numbers.",
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with local_fleet(tmp_path_factory.mktemp("fleet"), model=MODEL, timeout_s=120) as f:
        yield f


def run_gen(fleet, prompt, proposers, spec="ngram", **kw):
    chunks, done = [], None
    for msg in generate_remote(fleet["verifier"], fleet["key"], prompt=prompt,
                               proposers=proposers, proposer_spec=spec, **kw):
        if isinstance(msg, GenerateChunk):
            chunks.append(msg)
        elif isinstance(msg, GenerateDone):
            done = msg
    assert done is not None
    return chunks, done


def test_agents_discover_each_other_over_zeroconf(fleet):
    """A fresh browser (another process's view) sees both agents with their cards."""
    with Browser(fleet_id=fleet_id(fleet["key"]), interfaces=LOOPBACK_ONLY) as b:
        cards = b.wait_for(lambda cs: len(cs) >= 2, timeout=10)
    roles = sorted(r for c in cards for r in c.roles)
    assert roles == [ROLE_PROPOSER, ROLE_VERIFIER]
    assert all(c.models == (MODEL,) and c.mem_total > 0 for c in cards)
    # another fleet id sees nothing
    with Browser(fleet_id="not-this-fleet", interfaces=LOOPBACK_ONLY) as b:
        time.sleep(1.0)
        assert b.cards() == []


def test_status_and_ping(fleet):
    st = probe(fleet["proposer"], fleet["key"], pings=3)
    assert st.alive and isinstance(st.status, StatusReply)
    assert len(st.rtt_ms) == 3 and all(r < 500 for r in st.rtt_ms)


ALONE_TOKENS = 300  # long enough that a proposer killed after the first chunk dies mid-answer


@pytest.fixture(scope="module")
def alone(fleet) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from the verifier alone: one reference for both drafters
    and the killed proposer."""
    return {prompt: run_gen(fleet, prompt, [], "none", max_tokens=ALONE_TOKENS)[1].token_ids
            for prompt in PROMPTS}


def _remote(fleet, prompt, spec, check=lambda chunks, done: None, **kw):
    """The first of up to TRIES generations drafted (partly) by the remote proposer, each try
    checked by `check`. The verifier never waits for a proposer's session to open (the blocks
    decode plainly meanwhile), and a short generation of a tiny model can end first: each try
    is a fresh chance to observe remote drafting, instead of racing one open."""
    for _ in range(TRIES):
        chunks, done = run_gen(fleet, prompt, [fleet["proposer"].router_endpoint], spec, **kw)
        check(chunks, done)
        if done.stats.fleet.flows.remote_blocks > 0:
            return done
    raise AssertionError(f"the remote proposer was never asked in {TRIES} generations")


@pytest.mark.parametrize("spec", ["ngram", LAYERSKIP])
def test_greedy_across_agents_is_bit_identical_to_verifier_alone(fleet, alone, spec):
    for prompt in PROMPTS:
        def identical(chunks, done):
            assert done.token_ids == alone[prompt][:32]
            assert [t for c in chunks for t in c.token_ids] == done.token_ids

        # a set draft length: the tiny model's answers are no copy of the prompt, and the
        # adaptive length would stop asking n-gram after its first misses
        st = _remote(fleet, prompt, spec, identical, max_tokens=32, draft_tokens=4).stats
        assert st.fleet.flows.f1_bytes_per_block > 0 and st.fleet.flows.f2_bytes_per_block > 0
        assert 0 < st.fleet.multihost_overhead < 1  # remote blocks moved bytes


def test_sampling_across_agents_is_reproducible_with_a_seed(fleet):
    """A seed fixes the random draws; which draws a block uses depends on its drafts, so the
    drafting must be fixed too: a set draft length, no cross-round pre-drafting (both adapt
    to measured timings otherwise, and the test failed 1 run in 3 on a loaded box), and the
    proposer's session open from the same block in both runs (blocks before it decode plainly,
    other draws: a smollm2 pair failed so in a loaded run). Pairs are tried until both runs
    drafted the same number of blocks remotely, none failing."""
    ep = [fleet["proposer"].router_endpoint]
    kw = dict(max_tokens=16, temperature=0.8, seed=7, draft_tokens=4, cross_round=False)
    seen = []
    for _ in range(TRIES):
        a, b = (run_gen(fleet, PROMPTS[0], ep, LAYERSKIP, **kw)[1] for _ in range(2))
        fa, fb = a.stats.fleet, b.stats.fleet
        seen.append((fa.flows.remote_blocks, fb.flows.remote_blocks, a.token_ids == b.token_ids))
        if fa.flows.remote_blocks == fb.flows.remote_blocks > 0 and \
                fa.proposer_failures == fb.proposer_failures == 0:
            break
    else:
        raise AssertionError(f"no pair of {TRIES} drafted alike (remote blocks, same ids: {seen})")
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_bad_requests_get_typed_errors_and_the_agent_keeps_serving(fleet):
    with Client(fleet["verifier"].router_endpoint, key=fleet["key"]) as c:
        with pytest.raises(ProtocolError) as e:
            list(c.stream(__import__("bridge.messages", fromlist=["x"]).GenerateRequest(
                "r1", "hi", True, -5, 0.0, 1.0, None, -1, [], "none", True), 5))
        assert e.value.code == "bad_request"
        with pytest.raises(ProtocolError) as e:
            c.request(__import__("bridge.messages", fromlist=["x"]).DraftRequest(
                "nope", 1, [], 4, False), 5)
        assert e.value.code == "bad_request"  # a verifier does not serve drafts
        assert isinstance(c.request(Ping(1, 0), 5), Pong)
    # another fleet's key: CURVE never lets it connect, nothing comes back
    with Client(fleet["verifier"].router_endpoint, key=b"x" * 32, connect_timeout_s=1) as c:
        with pytest.raises(PeerUnavailable):
            c.request(StatusRequest(), 5)
    # an endpoint that is no agent of the fleet: refused before any connection (no SSRF);
    # dead proposers that are members are covered by test_zz_proposer_killed_mid_generation
    with pytest.raises(ProtocolError) as e:
        run_gen(fleet, PROMPTS[1], ["tcp://127.0.0.1:9"], "ngram", max_tokens=8)
    assert e.value.code == FORBIDDEN


def test_cli_ls_json_lists_the_fleet(fleet):
    env = dict(os.environ, MACFLEET_KEY=str(fleet["key_path"]))
    out = subprocess.run([sys.executable, "-m", "macfleet", "ls", "--json", "--wait", "2"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    names = {a["name"] for a in doc["agents"] if a["alive"]}
    assert {fleet["verifier"].name, fleet["proposer"].name} <= names
    assert all(a["rtt_p50_ms"] is not None for a in doc["agents"] if a["alive"])


def test_observer_sees_hosts_sessions_and_flows(fleet):
    """The dashboard's live source: both hosts alive with RTT, and a session with F1/F2 rows."""
    from macfleet.fleet.observer import FleetObserver

    obs = FleetObserver(fleet["key"], loopback=True, period_s=0.3)
    try:
        deadline = time.monotonic() + 20
        snap = None
        while time.monotonic() < deadline:
            snap = obs.poll(1.0) or snap
            if snap and len([h for h in snap.hosts if h.rtt_ms is not None]) >= 2:
                break
        assert snap is not None and {h.name for h in snap.hosts} >= {
            fleet["verifier"].name, fleet["proposer"].name}
        assert all(h.alive for h in snap.hosts)

        def drafted():  # a session with remote blocks (a try before the open has none)
            return [s for s in snap.sessions if (f2 := s.flow("F2")) and f2.bytes_per_block > 0]

        # an agent's metric stream drops what it published before the observer's
        # subscription took hold (seen live with RTT is not subscribed: failed once in a full
        # run on a loaded box), so generate again until a session shows, as the dashboard
        # test below does: each generation is a fresh chance to observe one
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _remote(fleet, PROMPTS[0], "ngram", max_tokens=16)
            for _ in range(3):
                snap = obs.poll(1.0) or snap
                if drafted():
                    break
            if drafted():
                break
        assert snap.sessions, "no BlockMetrics reached the observer"
        assert drafted() and drafted()[-1].blocks > 0, snap.sessions
        assert any(e.kind == "join" for e in snap.events)
    finally:
        obs.close()


def test_dashboard_live_on_a_generating_fleet(fleet):
    """`macfleet dash` on a real fleet: both hosts and a nonzero F2 row while a generation runs.

    The dashboard subscribes to an agent's metric stream only once it has discovered the agent,
    and a stream drops what was published before the subscription took hold: so the test waits
    for both hosts first, then generates again and again until the session shows (each
    generation is a fresh chance to observe it), instead of racing one short generation."""
    import asyncio
    import threading

    from textual.widgets import DataTable

    from macfleet.fleet.observer import FleetObserver
    from tui.app import FleetDashboard

    obs = FleetObserver(fleet["key"], loopback=True, period_s=0.3)
    app = FleetDashboard(obs, refresh_s=0.2)
    stop, gen_done = threading.Event(), threading.Event()
    runs = []

    def generate() -> None:
        try:
            while not stop.is_set():
                run_gen(fleet, PROMPTS[1], [fleet["proposer"].router_endpoint], "ngram",
                        max_tokens=24)
                runs.append(1)
        finally:
            gen_done.set()

    def seen() -> tuple[bool, bool]:
        snap = app.snapshot
        hosts = {fleet["verifier"].name, fleet["proposer"].name} <= {h.name for h in snap.hosts}
        f2 = [s.flow("F2") for s in snap.sessions]
        return hosts, any(f is not None and f.bytes_per_block > 0 for f in f2)

    async def wait_for(cond, deadline_s: float, pilot) -> bool:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if cond():
                return True
            await pilot.pause(0.2)
        return cond()

    async def scenario() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            assert await wait_for(lambda: seen()[0], 60, pilot), \
                f"dashboard saw hosts={[h.name for h in app.snapshot.hosts]}"
            threading.Thread(target=generate, daemon=True).start()
            ok = await wait_for(lambda: all(seen()), 90, pilot)
            stop.set()
            assert ok, f"dashboard saw sessions={len(app.snapshot.sessions)} after " \
                       f"{len(runs)} generations"
            assert app.hosts.query_one(DataTable).row_count >= 2
            await pilot.press("q")

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        gen_done.wait(120)
        obs.close()


# Runs last (pytest keeps definition order): it kills the module's proposer agent.
def test_zz_proposer_killed_mid_generation_loses_nothing(fleet, alone):
    """SIGKILL the proposer agent after the first streamed tokens: same ids as verifier alone."""
    prompt = PROMPTS[0]
    pid = fleet["agents"][ROLE_PROPOSER].pid
    ids, done, killed = [], None, False
    for msg in generate_remote(fleet["verifier"], fleet["key"], prompt=prompt,
                               max_tokens=ALONE_TOKENS,
                               proposers=[fleet["proposer"].router_endpoint],
                               proposer_spec=LAYERSKIP, draft_tokens=2):
        if isinstance(msg, GenerateChunk):
            ids.extend(msg.token_ids)
            if not killed:
                os.kill(pid, signal.SIGKILL)
                killed = True
        elif isinstance(msg, GenerateDone):
            done = msg
    assert killed and done is not None
    assert ids == done.token_ids == alone[prompt]
    assert done.stats.fleet.proposer_failures == 1
