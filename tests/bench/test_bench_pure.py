"""Pure parts of the f3 / sessions / topologies benches (no agents, no MLX work)."""

from __future__ import annotations

import pytest

from macfleet.bench.f3 import (Point, f3_payload_bytes, interp_loglog, percentile,
                               real_payloads)
from macfleet.bench.sessions import fairness


def test_f3_payload_bytes_is_hidden_x_layers_x_tokens_x_fp16():
    assert f3_payload_bytes(576, 1, 1) == 1152  # SmolLM2, EAGLE, one accepted token
    assert f3_payload_bytes(4096, 3, 4) == 98_304  # 8B, EAGLE-3, 4 tokens
    assert f3_payload_bytes(8192, 3, 5) == 245_760  # 70B, EAGLE-3, 5 tokens
    assert f3_payload_bytes(8192, 1, 1, dtype_bytes=4) == 32_768
    with pytest.raises(ValueError):
        f3_payload_bytes(-1, 1, 1)


def test_real_payloads_cover_every_verifier_drafter_and_token_count():
    rs = real_payloads()
    assert len(rs) == 3 * 2 * 5
    assert min(r.nbytes for r in rs) == 1152 and max(r.nbytes for r in rs) == 245_760


def test_interp_loglog_hits_points_and_is_linear_in_log_log():
    pts = [Point(1000, 1.0, 1.0, 1.0, 1), Point(100_000, 100.0, 100.0, 100.0, 1)]
    assert interp_loglog(pts, 1000) == 1.0
    assert interp_loglog(pts, 10_000) == pytest.approx(10.0)
    assert interp_loglog(pts, 10) == 1.0 and interp_loglog(pts, 1e9) == 100.0  # clamped


def test_percentile_nearest_rank():
    xs = list(range(1, 21))
    assert percentile(xs, 95) == 19 and percentile(xs, 50) == 10 and percentile(xs, 100) == 20


def test_fairness():
    assert fairness([2.0, 2.0])["jain_index"] == 1.0
    f = fairness([1.0, 3.0])
    assert f["min_over_max"] == pytest.approx(0.333, abs=1e-3) and f["jain_index"] == 0.8


def test_drafter_summary_pools_prompts_and_picks_the_best_by_geometric_mean():
    from macfleet.bench.drafter import best_spec, summarize

    plain = {"tokens": 64, "decode_tokens_per_s": 10.0, "blocks": 64, "drafted": 0,
             "accepted": 0, "accepted_hist": [], "draft_ms": 0.0, "verify_ms": 6400.0,
             "identical": True}
    spec = {"tokens": 64, "decode_tokens_per_s": 20.0, "blocks": 32, "drafted": 96,
            "accepted": 32, "accepted_hist": [8, 16, 8], "draft_ms": 160.0,
            "verify_ms": 3200.0, "identical": True}
    s = summarize([spec, spec], base_tps=10.0)
    assert s["tau"] == 1.0 and s["tokens_per_block"] == 2.0
    assert s["accept_at_position"] == [0.75, 0.25]  # P(>= 1 accepted), P(>= 2)
    assert s["speedup"] == 2.0 and s["all_identical"]
    summary = {"all": {"none": {"speedup_geomean": 1.0, "speedup_min": 1.0},
                       "a": {"speedup_geomean": 1.3, "speedup_min": 1.0},
                       "b": {"speedup_geomean": 1.1, "speedup_min": 0.99}}}
    assert best_spec(summary, ["none", "a", "b"]) == ("a", 1.3)
    # a drafter that is slower than plain on some prompt is not the default, however well it
    # does on average (measured: retrieval+ngram 1.53x on code, 0.91x on a chat question)
    summary["all"]["a"]["speedup_min"] = 0.90
    assert best_spec(summary, ["none", "a", "b"]) == ("b", 1.1)
    # none within the floor: the best worst case, and never plain decoding itself
    summary["all"]["b"]["speedup_min"] = 0.94
    assert best_spec(summary, ["none", "a", "b"]) == ("b", 1.1)
    assert summarize([plain], None)["tau"] == 0.0


def test_drafter_prompts_name_held_out_and_unseen_ones_and_group_by_kind():
    from macfleet.bench.drafter import _groups, prompt_kinds
    from macfleet.distill.prompts import HELD_OUT, UNSEEN

    assert prompt_kinds(None) == tuple(HELD_OUT)
    assert prompt_kinds("all") == (*HELD_OUT, *UNSEEN)
    assert prompt_kinds("code,unseen,chat:sky") == ("code", *UNSEEN)  # once each, in order
    for bad in ("chat,nope", ""):
        with pytest.raises(ValueError, match="unknown"):
            prompt_kinds(bad)

    def row(tps):
        return {"tokens": 10, "decode_tokens_per_s": tps, "blocks": 10, "drafted": 0,
                "accepted": 0, "accepted_hist": [], "draft_ms": 0.0, "verify_ms": 1.0,
                "identical": True}

    runs = {"chat:sky": {"none": row(10.0), "a": row(20.0)},
            "code:bank": {"none": row(10.0), "a": row(5.0)}}
    g = _groups(runs, ["none", "a"])
    assert g["chat"]["a"]["speedup_geomean"] == 2.0  # an unseen chat request counts as chat
    assert g["code"]["a"]["speedup_geomean"] == 0.5  # ... and "code:..." as code
    assert g["all"]["a"]["speedup_min"] == 0.5 and g["all"]["a"]["speedup_geomean"] == 1.0


@pytest.mark.slow
def test_disagg_summary_splits_gaps_at_the_window_and_plots(tmp_path):
    """Gaps ending before the long prompt's arrival count as 'before', those ending inside
    the window as the stall figures; a gap after the window counts for neither."""
    from macfleet.bench.disagg import Timed, plot, summarize

    short = Timed("short-1.0", 0.0, 0.5, (0.1,) * 10 + (0.3,) + (0.1,) * 9 + (5.0,), 21, (), {})
    long = Timed("long", 1.0, 1.5, (), 1, (), {"where": "remote"})
    # tokens at 0.5, 0.6, ..., 1.5, 1.8, 1.9, ..., 2.7, 7.7: 21 gaps, 4 after the window
    s = summarize([long, short], (1.45, 2.45))
    assert (s["gaps_in_window"], s["short_itl_before_s"]["gaps"]) == (8, 9)
    assert s["short_itl_s"]["max"] == 0.3 and s["short_itl_s"]["p50"] == 0.1
    assert s["short_itl_before_s"] == {"p50": 0.1, "p99": 0.1, "gaps": 9}
    assert s["p99_over_p50"] == 3.0 and s["long_ttft_s"] == 1.5
    pytest.importorskip("matplotlib")
    # the control has no long prompt: the same figures over its window
    c = summarize([short], (1.45, 2.45))
    assert c["short_itl_s"] == s["short_itl_s"] and c["long_ttft_s"] is None
    res = {"short_sessions": 1, "control": {"mode": "no long prompt (control)", **c},
           "busy_control": {"mode": "no long prompt, prefill agent busy (control)", **c},
           "sizes": [{"prompt_tokens": 2000, "modes": [{"mode": "prefill agent (auto)", **s}]}]}
    assert plot(res, tmp_path / "disagg.png").stat().st_size > 0


def test_head_to_head_ratio_summary_is_per_round():
    from macfleet.bench.serve import ratio_summary

    s = ratio_summary([(150.0, 100.0), (120.0, 100.0), (90.0, 60.0), (10.0, 0.0)])
    assert s["rounds"] == 3  # a round whose baseline made nothing is not a ratio
    assert s["ratio_median"] == 1.5 and s["ratio_min"] == 1.2 and s["ratio_max"] == 1.5
    assert s["rounds_at_least"] == {"1": 3, "1.5": 2}
    assert ratio_summary([]) == {"rounds": 0}


def test_repeated_drafter_runs_keep_the_median_and_any_difference():
    from macfleet.bench.drafter import median_run

    rows = [{"decode_tokens_per_s": t, "identical": i} for t, i in
            ((20.0, True), (14.0, True), (17.0, False))]
    m = median_run(rows)
    assert m["decode_tokens_per_s"] == 17.0 and m["repeats_tokens_per_s"] == [20.0, 14.0, 17.0]
    assert m["identical"] is False  # one run that differed is not hidden by the median
    assert median_run(rows[:2])["decode_tokens_per_s"] == 14.0  # even count: the lower one


def test_training_curve_trend_says_how_many_tokens_reach_the_goal():
    from macfleet.bench.drafter import curve_fit

    # 1.0 at 2^20 tokens, +0.1 per doubling: 2.5 at 2^35
    curve = [{"train_tokens": 2 ** e, "mean_accepted": 1.0 + 0.1 * (e - 20)}
             for e in range(20, 28)]
    f = curve_fit(curve)
    assert f["b_per_doubling"] == pytest.approx(0.1)
    assert f["train_tokens_for_goal"] == pytest.approx(2 ** 35, rel=1e-6)
    assert f["train_tokens_now"] == 2 ** 27
    flat = [{"train_tokens": 2 ** e, "mean_accepted": 1.5} for e in range(20, 24)]
    assert curve_fit(flat)["train_tokens_for_goal"] is None
    assert curve_fit(curve[:1]) is None


def test_bench_fleet_sets_the_first_request_against_the_median_warm_one():
    from macfleet.bench.fleet import first_vs_warm

    def run(tps, prefill):
        return {"tokens_per_s": tps, "prefill_ms": prefill}

    got = first_vs_warm(run(5.0, 3000.0), [run(10.0, 100.0), run(8.0, 150.0), run(12.0, 120.0)])
    assert got["warm_tokens_per_s"] == 10.0
    assert got["first_over_warm"] == 0.5 and got["prefill_ms_first_over_warm"] == 25.0
    assert first_vs_warm(run(5.0, 1.0), [run(0.0, 0.0)])["first_over_warm"] == 0.0


def test_auto_is_compared_with_the_best_fixed_drafter_of_the_same_run():
    """`auto` is never the recorded best (a record names a fixed drafter); its ratio to the
    best fixed one is the geometric mean over prompts (issue 44's goal: >= 0.97)."""
    from macfleet.bench.drafter import AUTO, auto_vs_best_fixed, best_spec, fixed_specs

    def row(tps):
        return {"decode_tokens_per_s": tps}

    runs = {"p1": {"none": row(10.0), "a": row(13.0), "b": row(11.0), AUTO: row(13.0)},
            "p2": {"none": row(10.0), "a": row(12.0), "b": row(12.5), AUTO: row(11.4)}}
    summary = {"all": {"none": {"speedup_geomean": 1.0, "speedup_min": 1.0},
                       "a": {"speedup_geomean": 1.249, "speedup_min": 1.2},
                       "b": {"speedup_geomean": 1.173, "speedup_min": 1.1},
                       AUTO: {"speedup_geomean": 1.5, "speedup_min": 1.14,
                              "all_identical": True}}}
    specs = ["none", "a", "b", AUTO]
    assert fixed_specs(specs) == ["none", "a", "b"]
    assert best_spec(summary, fixed_specs(specs))[0] == "a"
    vs = auto_vs_best_fixed(runs, summary, specs)
    assert vs["best_fixed"] == "a" and vs["auto_speedup_min"] == 1.14
    assert vs["auto_vs_best_geomean"] == pytest.approx((1.0 * 11.4 / 12.0) ** 0.5, abs=1e-3)
    assert vs["auto_vs_best_min"] == pytest.approx(0.95) and vs["auto_identical"]
    assert vs["top_fixed"] == "a" and vs["auto_vs_top_geomean"] == vs["auto_vs_best_geomean"]
    assert auto_vs_best_fixed(runs, summary, ["none", "a", "b"]) is None
    # every fixed drafter below the floor on a prompt: the record's rule names the best worst
    # prompt (b), and auto is also read against the best geomean (a)
    summary["all"]["a"]["speedup_min"], summary["all"]["b"]["speedup_min"] = 0.80, 0.90
    vs = auto_vs_best_fixed(runs, summary, specs)
    assert vs["best_fixed"] == "b" and vs["top_fixed"] == "a"
    assert vs["auto_vs_best_geomean"] == pytest.approx((13.0 / 11.0 * 11.4 / 12.5) ** 0.5,
                                                       abs=1e-3)
    assert vs["auto_vs_top_geomean"] == pytest.approx((1.0 * 11.4 / 12.0) ** 0.5, abs=1e-3)


def test_autos_verdict_reads_three_decimals_and_the_stricter_best():
    """0.967 is a goal missed (two decimals printed it "0.97x"), and the geomean goal is read
    against the best geomean of a fixed drafter when the record's rule names another."""
    from macfleet.bench.drafter import auto_verdict

    vs = {"best_fixed": "r", "auto_speedup_geomean": 1.475, "auto_speedup_min": 0.967,
          "auto_vs_best_geomean": 1.025, "top_fixed": "r", "auto_vs_top_geomean": 1.025}
    line = auto_verdict(vs)
    assert "slowest prompt 0.967x" in line and "1.025x the best fixed drafter r (" in line
    assert "the best fixed met, the slowest prompt missed" in line
    vs.update(best_fixed="e", auto_vs_best_geomean=1.12, auto_vs_top_geomean=0.96,
              auto_speedup_min=0.99)
    line = auto_verdict(vs)
    assert "1.120x the best fixed drafter e, 0.960x the best geomean (r)" in line
    assert "the best fixed missed, the slowest prompt met" in line
    # a record from before `top_fixed`
    del vs["top_fixed"], vs["auto_vs_top_geomean"]
    assert "the best fixed met" in auto_verdict(vs)


def test_auto_is_measured_across_agents_on_the_verifier_agents_own_drafters():
    """`bench drafter` without --no-agents: `auto` asked for runs through the 2-agent fleet
    too, sent with no proposer endpoints (the verifier agent chooses among its own drafters,
    as the fleet client sends it); a fixed drafter names one endpoint per drafter."""
    from macfleet.bench.drafter import AUTO, agent_endpoints, agent_specs

    specs = ("none", "eagle", "eagle2", "retrieval+ngram", AUTO)
    assert agent_specs(specs, "retrieval+ngram") == (
        "none", "retrieval+ngram", "eagle", "eagle2", AUTO)
    assert agent_specs(("none", "retrieval", "eagle"), "retrieval") == (
        "none", "eagle", "retrieval")
    assert agent_endpoints(AUTO, "ep") == [] and agent_endpoints("none", "ep") == []
    assert agent_endpoints("retrieval+ngram", "ep") == ["ep", "ep"]


def test_the_machines_drift_is_read_off_autos_plain_blocks():
    from macfleet.bench.drafter import machine_drift

    def t(drafter, ms):
        return {"drafter": drafter, "verify_ms": ms}

    runs = {"chat": {"none": {"blocks": 4, "verify_ms": 400.0},
                     "auto": {"trace": [t("none", 300.0), t("eagle2", 900.0), t("none", 500.0)]}},
            "code": {"none": {"blocks": 2, "verify_ms": 200.0},
                     "auto": {"trace": [t("eagle2", 900.0)]}},
            "list": {"none": {"blocks": 2, "verify_ms": 200.0}}}
    # chat: auto's plain steps 400 ms against plain's 100: the machine ran 4x slower; code
    # and list: no plain block of auto's to tell
    assert machine_drift(runs) == {"chat": 4.0}
