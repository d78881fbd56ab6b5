"""The dashboard's links (fleet/observer.py `link_views`): one row per (verifier, proposers)
pair, over every session that crossed it. Two sessions on one pair were two links with one
row key, and the live dashboard died of Textual's DuplicateKey (test_fleet_processes' live
dashboard test, once, in a fresh-clone run)."""

from __future__ import annotations

from macfleet.fleet.observer import link_views
from macfleet.fleet.snapshot import BlockSample, SessionView


def session(sid: str, verifier: str, proposers: tuple[str, ...], wires: list[float]
            ) -> SessionView:
    return SessionView(
        session_id=sid, verifier=verifier, proposers=proposers, topology="1:1",
        tokens_per_s=1.0, acceptance=0.5, mean_accepted=1.0, draft_len=4, blocks=len(wires),
        accepted_hist=(), flows=(), overhead_share=0.0, active=True,
        timeline=tuple(BlockSample(block=i, k=4, accepted=1, block_ms=10.0, draft_ms=1.0,
                                   verify_ms=5.0, wire_ms=w) for i, w in enumerate(wires)))


def test_two_sessions_on_one_pair_are_one_link_over_both():
    links = link_views([session("a", "v", ("p",), [1.0, 2.0, 3.0]),
                        session("b", "v", ("p",), [4.0, 5.0]),
                        session("c", "v", ("q",), [9.0]),
                        session("d", "v", (), [0.0, 0.0])])  # no wire time: no link
    assert [(x.src, x.dst) for x in links] == [("v", "p"), ("v", "q")]
    assert len({(x.src, x.dst) for x in links}) == len(links)  # the dashboard's row keys
    p = links[0]
    assert (p.rtt_p50_ms, p.rtt_p95_ms) == (3.0, 5.0)  # over all five wire times


def test_a_session_without_named_proposers_is_the_proposer_link():
    (link,) = link_views([session("a", "v", (), [2.0])])
    assert (link.src, link.dst, link.rtt_p50_ms) == ("v", "proposer", 2.0)
