"""The planner's disaggregation decision (topology/disagg.py): remote only when it pays."""

from __future__ import annotations

from dataclasses import replace

from macfleet.topology.disagg import DisaggInputs, decide

# SmolLM2-135M-like: 30 layers x 3 KV heads x 64 dims, float16 K and V: 23 KB per token
KV_F16 = 2 * 30 * 3 * 64 * 2
BASE = DisaggInputs(prompt_tokens=2001, prefill_agents=1, kv_bytes_per_token=KV_F16,
                    local_prefill_tok_s=100.0, remote_prefill_tok_s=100.0,
                    link_bytes_per_s=110e6, link_rtt_ms=1.0)


def test_long_prompt_on_a_fast_link_goes_remote():
    d = decide(BASE)
    assert d.remote
    assert d.kv_bytes == 2000 * KV_F16
    assert abs(d.local_ms - 20000) < 1e-6
    assert d.saved_ms > 19000 and d.remote_ms < 1.5 * d.local_ms
    assert "frees" in d.reason


def test_no_prefill_agent():
    d = decide(replace(BASE, prefill_agents=0))
    assert not d.remote and d.reason == "no prefill agent in the fleet"


def test_short_prompt_stays_local_and_says_why():
    d = decide(replace(BASE, prompt_tokens=300))
    assert not d.remote and "under 512" in d.reason


def test_slow_link_stays_local():
    # 46 MB over 1 MB/s: 46 s on the wire against a 20 s local prefill
    d = decide(replace(BASE, link_bytes_per_s=1e6))
    assert not d.remote
    assert d.transfer_ms > 40000 and "first token would wait" in d.reason


def test_fast_local_prefill_frees_too_little():
    # a Mac that prefills 20k tokens/s spends 100 ms: not worth a round trip
    d = decide(replace(BASE, local_prefill_tok_s=20000.0, remote_prefill_tok_s=20000.0,
                       min_saved_ms=200.0))
    assert not d.remote and "free only" in d.reason


def test_streaming_overlaps_compute_and_wire():
    # compute 20 s, wire 0.4 s: the first token waits for the compute plus a chunk's wire
    d = decide(BASE)
    assert d.remote_ms < 20000 + d.transfer_ms
    assert d.remote_ms >= 20000


def test_a_slower_prefill_agent_is_refused_when_the_wait_grows_too_much():
    d = decide(replace(BASE, remote_prefill_tok_s=50.0))  # 40 s vs 20 s local
    assert not d.remote
    d = decide(replace(BASE, remote_prefill_tok_s=80.0))  # 25 s vs 20 s: within 1.5x
    assert d.remote


def test_plan_disagg_reads_the_fleet():
    """`macfleet plan`'s long-prompt lines: no prefill host -> the verifier, with its reason; a
    prefill host on a fast link takes an 8,000-token prompt; over a slow link it does not."""
    from macfleet.topology.disagg import plan_disagg
    from macfleet.topology.fleet_spec import Fleet, Host, Link

    alone = plan_disagg(Fleet(hosts=(Host("v"),)))
    assert [d.prompt_tokens for d in alone] == [2000, 8000]
    assert not any(d.decision.remote for d in alone) and alone[0].prefill_host == ""
    hosts = (Host("v", roles=("verifier",)), Host("p", roles=("prefill",)))
    fast = plan_disagg(Fleet(hosts=hosts, links=(Link("v", "p", 0.2, 2000.0),)), (8000,))[0]
    assert fast.decision.remote and fast.prefill_host == "p" and fast.verifier == "v"
    # 8,000 tokens of SmolLM2's float16 KV = 184 MB: ~3 min at 1 MB/s
    slow = plan_disagg(Fleet(hosts=hosts, links=(Link("v", "p", 0.2, 1.0),)), (8000,))[0]
    assert not slow.decision.remote and "MB/s" in slow.decision.reason
    assert slow.decision.kv_bytes == fast.decision.kv_bytes == 7999 * 2 * 30 * 3 * 64 * 2
