"""bench pair's arithmetic (macfleet/bench/pair.py): ceilings, acceptance, the summary."""

from __future__ import annotations

import pytest

from macfleet.bench.pair import (Costs, alpha_from_mean, best_two_agent, identical, with_alone,
                                 one_process_speedup, sessions_figure, summarize,
                                 two_agent_speedup, with_plain)
from macfleet.engine.controller import expected_tokens

COSTS = Costs({1: 160.0, 5: 200.0, 9: 240.0}, 64.0)


def test_costs_interpolate_and_extrapolate_verify():
    assert COSTS.verify(3) == pytest.approx(180.0)
    assert COSTS.verify(13) == pytest.approx(280.0)
    assert COSTS.c == pytest.approx(0.4)


def test_alpha_from_mean_inverts_the_expected_accepted_drafts():
    for a in (0.3, 0.6, 0.9):
        mean = expected_tokens(a, 4) - 1  # accepted drafts of a 4-block
        assert alpha_from_mean(mean, 4) == pytest.approx(a, abs=1e-6)
    assert alpha_from_mean(4.0, 4) == pytest.approx(1.0, abs=1e-6)


def test_ceilings():
    # in series: k draft steps + verify(k+1)
    assert one_process_speedup(1.0, 4, COSTS) == pytest.approx(5 * 160 / (4 * 64 + 200))
    # ahead: the longer of verify(k+1) and the k+1 draft steps
    assert two_agent_speedup(1.0, 4, COSTS) == pytest.approx(5 * 160 / (5 * 64))
    assert two_agent_speedup(1.0, 1, COSTS) == pytest.approx(2 * 160 / 170)
    k, best = best_two_agent(0.95, COSTS)
    assert best == max(two_agent_speedup(0.95, j, COSTS) for j in range(1, 17))
    assert best > one_process_speedup(0.95, k, COSTS)


def run(ids, rate=10.0):
    return {"ids": ids, "tok_s": rate, "drafted": 8, "accepted": 6, "blocks": 3}


def test_summary_figures_and_identity():
    one = {"costs": {"verify_ms": {"1": 160.0, "5": 200.0}, "draft_ms": 64.0}, "eos": [2],
           "runs": [{"prompt": "p", "plain": run([5, 6], 10.0), "mlx_plain": run([5, 6, 2], 9.0),
                     "spec": run([5, 6], 15.0), "mlx_spec": run([5, 6, 2], 14.0)}]}
    two = {"runs": [{"prompt": "p", "agent_alone": run([5, 6], 9.5),
                     "pair": {**run([5, 6], 24.0), "lead": 2.0, "waste": 0.1, "wait_ms": 3.0,
                              "failures": 0}}]}
    r = summarize(width=6144, target=0.95, dial={"eps": 0.1}, k=4, one=one, two=two)
    assert r["identical"]
    f = r["figures"]
    assert f["two agents / plain"]["geomean"] == pytest.approx(2.4)
    assert f["two agents / in-process draft model"]["geomean"] == pytest.approx(1.6)
    assert f["plain macfleet / mlx-lm plain"]["geomean"] == pytest.approx(10 / 9)
    assert f["two agents / plain"]["ceiling"] > 1
    bad = {**two, "runs": [{**two["runs"][0], "pair": {**two["runs"][0]["pair"],
                                                        "ids": [5, 7]}}]}
    assert not summarize(width=6144, target=0.95, dial={}, k=4, one=one, two=bad)["identical"]
    # bench pair --skip plain: no one-process plain runs; plain decoding is the agent's alone
    noplain = {**one, "runs": [{k: v for k, v in one["runs"][0].items()
                                if k not in ("plain", "mlx_plain")}]}
    f = summarize(width=6144, target=0.95, dial={}, k=4, one=noplain, two=two)["figures"]
    assert "two agents / plain" not in f and "plain macfleet / mlx-lm plain" not in f
    assert f["two agents / verifier agent alone"]["geomean"] == pytest.approx(24 / 9.5)
    assert f["two agents / verifier agent alone"]["ceiling"] > 1
    assert f["in-process draft model / verifier agent alone"]["geomean"] == \
        pytest.approx(15 / 9.5)


def test_plain_runs_of_another_setting_fill_in_without_their_ids():
    one = {"runs": [{"prompt": "p", "spec": run([1]), "mlx_spec": run([1])}]}
    got = with_plain(one, {"p": {"plain": run([9], 3.0), "mlx_plain": run([9], 2.0)}})
    assert got["runs"][0]["plain"]["tok_s"] == 3.0 and got["runs"][0]["plain"]["ids"] is None
    assert identical(got, None)  # the other verifier's ids are not compared


def test_agent_alone_runs_of_another_setting_fill_in_without_their_ids():
    two = {"runs": [{"prompt": "p", "pair": run([1], 6.0)},
                    {"prompt": "q", "pair": run([2], 6.0), "agent_alone": run([2], 1.5)}]}
    got = with_alone(two, {"p": run([9], 2.0), "q": run([8], 9.0)})
    p, q = got["runs"]
    assert p["agent_alone"]["tok_s"] == 2.0 and p["agent_alone"]["ids"] is None
    assert q["agent_alone"] == run([2], 1.5)  # measured here: kept, ids compared
    assert identical(None, got)


def test_mlx_runs_are_timed_by_commit_as_macfleet_runs_are(monkeypatch):
    """mlx-lm's speculative step yields a block's tokens one by one, the verifier's own token
    last: the first block (drafted and verified before the clock starts) counts as the first
    commit, as macfleet's first TokensCommitted does, never as tokens after it."""
    import macfleet.bench.pair_run as pr

    clock = iter([1.0, 2.0, 3.0, 4.0, 5.0])
    monkeypatch.setattr(pr.time, "perf_counter", lambda: next(clock))
    spec = [(5, None, True), (6, None, True), (7, None, False),  # block 1: t=1
            (8, None, False),  # t=2
            (9, None, True), (2, None, True)]  # the EOS ends a commit: t=3
    ids, rate = pr._mlx_run(iter(spec), frozenset({2}))
    assert ids == [5, 6, 7, 8, 9, 2]
    assert rate == pytest.approx(3 / 2)  # 1 + 2 tokens after the first commit, in 2 s
    clock = iter([1.0, 2.0, 3.0])
    ids, rate = pr._mlx_run(iter([(5, None), (6, None), (7, None)]), frozenset())
    assert ids == [5, 6, 7] and rate == pytest.approx(1.0)  # plain: every token a commit


def _round(spec: str, tok_s: float, answers: dict) -> dict:
    return {"spec": spec, "tok_s": tok_s, "answers": [{"prompt": p, "ids": ids}
                                                      for p, ids in answers.items()]}


def test_sessions_at_once_are_a_figure_and_must_answer_as_alone():
    two = {"runs": [{"prompt": "p", "agent_alone": run([5, 6], 9.0),
                     "pair": {**run([5, 6], 18.0), "lead": 2.0, "waste": 0.1, "wait_ms": 3.0,
                              "failures": 0}}],
           "sessions": {"n": 4, "rounds": [_round("none", 10.0, {"p": [5, 6]}),
                                           _round("draft", 20.0, {"p": [5, 6, 2]}),
                                           _round("draft", 24.0, {"p": [5, 6]}),
                                           _round("none", 8.0, {"p": [5, 6]})]}}
    name, fig = sessions_figure(two)
    assert name == "two agents, 4 sessions at once / verifier agent alone"
    assert fig["each"] == pytest.approx([2.0, 3.0])  # round by round, in the order run
    r = summarize(width=6144, target=0.95, dial={}, k=4, one=None, two=two, eos=[2])
    assert r["identical"] and r["figures"][name]["geomean"] == pytest.approx(6 ** 0.5)
    # a batched answer that differs from the same prompt's answer alone
    bad = {**two, "sessions": {**two["sessions"], "rounds": two["sessions"]["rounds"][:3]
                               + [_round("none", 8.0, {"p": [5, 7]})]}}
    assert not identical(None, bad, [2])
    assert sessions_figure({"runs": []}) is None


def test_requests_at_once_run_together_in_order_and_a_failure_is_raised():
    import threading

    from macfleet.bench.pair_run import at_once

    barrier = threading.Barrier(3, timeout=5)  # each ask returns only once all three started

    def ask(text: str) -> dict:
        barrier.wait()
        return {"ids": [len(text)]}

    wall, got = at_once(ask, ["a", "bb", "ccc"])
    assert [g["ids"] for g in got] == [[1], [2], [3]] and wall < 5

    def bad(text: str) -> dict:
        raise RuntimeError(f"lost {text}")

    with pytest.raises(RuntimeError, match="lost"):
        at_once(bad, ["x"])


def test_a_row_without_the_one_process_runs_prints_and_plots(tmp_path, capsys):
    """`bench pair --skip one --sessions 4`: no c, no acceptance measured (it crashed on
    printing them, after the whole run and before writing it)."""
    from macfleet.cli.bench_pair import _plot, _print_row

    two = {"runs": [{"prompt": "p", "agent_alone": run([5, 6], 9.0),
                     "pair": {**run([5, 6], 18.0), "lead": 2.0, "waste": 0.1, "wait_ms": 3.0,
                              "failures": 0}}],
           "sessions": {"n": 4, "rounds": [_round("none", 10.0, {"p": [5, 6]}),
                                           _round("draft", 20.0, {"p": [5, 6]})]}}
    row = summarize(width=5120, target=0.95, dial={}, k=4, one=None, two=two)
    _print_row(row)
    out = capsys.readouterr().out
    assert "c, acceptance not run" in out and "4 sessions at once" in out and "2.00x" in out
    plotted = _plot([row], tmp_path / "pair.png")
    assert plotted is None or plotted.is_file()
    assert _plot([{**row, "figures": {}}], tmp_path / "none.png") is None  # nothing measured
