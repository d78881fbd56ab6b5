"""`bench overhead`: the pure parts (ideal speed-ups, departures, summaries, the device's tag,
argument parsing), the verifiers it builds, and the command end to end on a tiny model."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from macfleet.bench import overhead as ov
from macfleet.bench import weights as w


def test_first_departure_is_the_first_differing_answer_position():
    assert ov.first_departure([1, 2, 3], [1, 2, 3]) is None
    assert ov.first_departure([1, 2, 3], [1, 5, 3]) == 1
    assert ov.first_departure([1, 2, 3], [1, 2]) == 2  # stopped early
    assert ov.first_departure([1, 2], [1, 2, 3]) == 2
    assert ov.first_departure([], []) is None


def device_like(flip_at: set[int]):
    """A fake device whose block decoding commits token+100 at the positions in `flip_at`
    where the reference still has the one-token answer (a near-tie resolved the other way),
    and follows the reference otherwise."""
    def run(ref):
        return tuple(t + 100 if i in flip_at and t < 100 else t for i, t in enumerate(ref))
    return run


def test_follow_reference_reruns_on_the_departed_runs_own_answer():
    plain = (1, 2, 3, 4, 5)
    t = ov.follow_reference(device_like({1, 3}), plain)
    assert t.departures == (1,) and t.converged and t.runs == 2
    assert t.reference == (1, 102, 3, 104, 5)
    same = ov.follow_reference(device_like(set()), plain)
    assert same.departures == () and same.converged and same.runs == 1
    assert same.reference == plain


def test_follow_reference_stops_at_its_cap_and_says_it_did_not_converge():
    def wandering(ref):  # a device that never settles
        return (ref[0] + 1, *ref[1:])
    t = ov.follow_reference(wandering, (1, 2), max_runs=3)
    assert t.departures == (0, 0, 0) and not t.converged and t.runs == 3


def test_ideal_speedup_and_the_loops_efficiency_come_from_the_verify_curve():
    vm = {1: 10.0, 2: 10.0, 4: 12.5, 8: 20.0}
    assert ov.ideal_speedup(vm, 1) == pytest.approx(2.0)
    assert ov.ideal_speedup(vm, 3) == pytest.approx(3.2)
    assert ov.ideal_speedup(vm, 7) == pytest.approx(4.0)
    s = ov.oracle_summary({"a": 1.6, "b": 3.2}, vm, 3, all_accepted=True)
    assert s["speedup_geomean"] == pytest.approx(math.sqrt(1.6 * 3.2), abs=1e-3)
    assert s["ideal_speedup"] == 3.2
    assert s["efficiency"] == pytest.approx(s["speedup_geomean"] / 3.2, abs=1e-3)
    assert s["speedup_min"] == 1.6


def test_ratio_summary_is_per_prompt_with_a_geomean_and_the_lowest():
    r = ov.ratio_summary({"x": 2.0, "y": 8.0, "z": 1.0}, {"x": 1.0, "y": 2.0})
    assert r["per_prompt"] == {"x": 2.0, "y": 4.0} and r["min"] == 2.0
    assert r["geomean"] == pytest.approx(math.sqrt(8.0), abs=1e-3)
    assert ov.best([ov.Run((), 3.0, 1.0), ov.Run((), 5.0, 0.5)]) == 5.0
    assert ov.best([ov.Run((), 3.0, 1.0)], "stream_tps") == 1.0


def test_departure_summary_counts_runs_that_left_one_token_decoding():
    traces = {"a:k1": ov.OracleTrace((1,), (), True),
              "a:k3": ov.OracleTrace((1,), (17,), True),
              "b:k3": ov.OracleTrace((1,), (40, 52, 60, 61), False)}
    d = ov.departure_summary(traces)
    assert (d["runs"], d["departed"], d["rate"]) == (3, 2, 0.667)
    assert d["first_positions"] == {"a:k3": 17, "b:k3": 40}
    assert d["not_converged"] == ["b:k3"] and d["max_runs_used"] == 4


@pytest.mark.parametrize("device, gpu, chip, tag", [
    ("Device(cpu, 0)", "", "AMD EPYC", "cpu"),
    ("Device(gpu, 0)", "NVIDIA H100 80GB HBM3", "", "h100"),
    ("Device(gpu, 0)", "NVIDIA H200", "Intel Xeon", "h200"),
    ("Device(gpu, 0)", "", "Apple M2 Max", "m2-max"),
    ("Device(gpu, 0)", "", "Apple M4", "m4"),
    ("Device(gpu, 0)", "", "", "gpu"),
])
def test_the_results_file_is_named_after_the_device(device, gpu, chip, tag):
    assert ov.device_tag(device, gpu, chip) == tag


def test_bad_arguments_are_refused_with_the_choices():
    assert ov.parse_ks("7,1,3,3") == (1, 3, 7)
    assert ov.parse_skip("a, d") == {"a", "d"}
    assert w.parse_dtypes("float32,bfloat16") == ("float32", "bfloat16")
    assert w.parse_shapes("1b,8b") == ("1b", "8b") and w.parse_shapes("none") == ()
    for bad in (lambda: ov.parse_ks("0,3"), lambda: ov.parse_ks("x"),
                lambda: ov.parse_skip("e"), lambda: w.parse_dtypes("int8"),
                lambda: w.parse_shapes("70b")):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("shape", ["1b", "3b", "8b"])
def test_big_shapes_have_the_size_of_the_models_they_stand_for(shape):
    n = w.param_count(w.big_args(shape))
    assert {"1b": (1.1e9, 1.4e9), "3b": (3.0e9, 3.4e9), "8b": (7.8e9, 8.2e9)}[shape][0] \
        < n < {"1b": (1.1e9, 1.4e9), "3b": (3.0e9, 3.4e9), "8b": (7.8e9, 8.2e9)}[shape][1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, weights", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                            ("4bit", "quantized")])
def test_a_random_llama_is_built_in_the_asked_dtype_and_counted(dtype, weights):
    bm = w.random_llama("mini", dtype)
    assert bm.weights == weights and bm.lm is None
    dense = w.random_llama("mini", "float32").model
    assert bm.params == w.count_params(bm.model) == w.count_params(dense) \
        == sum(v.size for _, v in tree_flatten(dense.parameters()))
    logits = bm.model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, w.BIG_SHAPES["mini"]["vocab_size"])


@pytest.mark.parametrize("tile", [True, False])
def test_random_weights_are_drawn_or_tiled_at_the_scale_of_the_fan_in(tile):
    from mlx_lm.models import llama

    model = llama.Model(w.big_args("mini"))
    w.fill_random(model, "float32", seed=1, tile=tile)
    q = np.array(model.model.layers[0].self_attn.q_proj.weight)
    bound = 1 / math.sqrt(q.shape[-1])
    assert np.abs(q).max() <= bound * 1.0001 and q.std() > bound / 3
    assert len({tuple(r) for r in q.round(6)}) == q.shape[0]  # no two rows alike
    assert np.all(np.array(model.model.norm.weight) == 1)


def test_the_projects_model_in_another_dtype_leaves_the_cached_one_alone():
    from macfleet.engine.models import load_model

    cached = load_model("tiny:3")
    bm = w.project_model("tiny:3", "bfloat16")
    assert bm.weights == "bfloat16" and bm.lm.tokenizer is not None
    q = w.project_model("tiny:3", "4bit")
    assert q.weights == "quantized" and q.params == bm.params
    assert w.weights_format(cached.model) == "float32"
    assert w.project_model("tiny:3", "native").model is cached.model


def _section() -> dict:
    return {"label": "m", "weights": "float32", "params": 135e6,
               "verify_ms": {"1": 4.0, "2": 4.0, "4": 5.0},
               "plain_vs_mlx": {"geomean": 0.9, "min": 0.8},
               "oracle": [ov.oracle_summary({"p": 3.0}, {1: 4.0, 4: 5.0}, 3, True)],
               "departures": ov.departure_summary({"p:k3": ov.OracleTrace((), (5,), True)})}


def test_headline_reads_a_section_back_from_json():
    lines = ov.headline(json.loads(json.dumps(_section())))
    assert "verify(1) 4.0 ms" in lines[0] and "135.0M" in lines[0]
    assert any(f"efficiency {round(3.0 / 3.2, 3)}" in s for s in lines)  # ideal 4 * 4.0 / 5.0
    assert any("1 of 1 runs" in s for s in lines)


@pytest.mark.slow
def test_the_plot_reads_sections_back_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    doc = {"device": "cpu", "sections": [json.loads(json.dumps(_section()))]}
    assert ov.plot(doc, tmp_path / "o.png") and (tmp_path / "o.png").stat().st_size > 0


def test_past_the_deadline_no_further_round_starts_and_the_section_says_how_many_ran():
    import time

    from macfleet.bench.overhead_run import measure_model

    bm = w.project_model("tiny:1", "native")
    s = measure_model(bm, {"p": [1, 2, 3]}, tokens=4, rounds=3, ks=(1,), mlx=False,
                      curve_lengths=(1, 2), deadline=time.monotonic() - 1)
    assert s["rounds"] == 1
    assert len(s["prompts"]["p"]["methods"]["oracle k=1"]["decode_tps"]) == 1
    assert "plain_vs_mlx" not in s and s["oracle"][0]["all_accepted"]


@pytest.mark.slow
def test_bench_overhead_end_to_end_on_a_tiny_model(tmp_path, capsys):
    from macfleet.cli.main import main

    rc = main(["bench", "--out", str(tmp_path), "overhead", "--model", "tiny:1", "--max-tokens",
               "8", "--repeats", "1", "--prompts", "1", "--ks", "1,3", "--big-shape", "mini",
               "--big-ks", "3", "--big-prompts", "1", "--big-max-tokens", "8"])
    assert rc == 0
    doc = json.loads((tmp_path / "overhead-cpu.json").read_text())
    assert doc["device"] == "cpu" and doc["ks"] == [1, 3]
    tiny, big = doc["sections"]
    assert tiny["label"] == "tiny:1 native" and big["label"] == "random llama mini float32"
    for s in (tiny, big):
        assert s["plain_vs_mlx"]["geomean"] > 0
        assert s["pipelined_vs_synchronous"]["geomean"] > 0
        assert s["sampled_plain_vs_mlx"]["geomean"] > 0
        assert all(o["all_accepted"] and o["ideal_speedup"] > 0 for o in s["oracle"])
        assert s["departures"]["runs"] == len(s["oracle"]) * len(s["prompts"])
        for p in s["prompts"].values():
            assert p["methods"]["plain"]["identical_to_plain"]
            assert p["methods"]["mlx_generate_step"]["identical_to_plain"]
            assert p["methods"]["plain (synchronous)"]["identical_to_plain"]
    assert [o["k"] for o in tiny["oracle"]] == [1, 3] and [o["k"] for o in big["oracle"]] == [3]
    c = tiny["default_drafter"]
    assert c["error"] is None and c["speedup"]["geomean"] > 0
    # generate --local's path, text and all, exact
    methods = next(iter(tiny["prompts"].values()))["methods"]
    assert methods["plain (text)"]["identical_to_plain"]
    assert methods[c["spec"]]["identical_to_plain"]
    out = capsys.readouterr().out
    assert "(a) plain macfleet / mlx-lm generate_step" in out and "wrote" in out
