"""The pair verifier (bench/pair_model.py) and its dials (bench/pair_dial.py): the
transformations on a tiny random llama (fast), the cache key, the atomic write, the bisection;
the real wide SmolLM2 against the embedded one (slow)."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import pytest

from macfleet.bench import pair_model as pm
from macfleet.bench.pair_dial import agreement_models, bisect_log
from macfleet.engine.tiny import build_tiny_model

IDS = [3, 17, 5, 42, 8, 8, 21, 30, 1, 13, 60, 2]


def _tiny():
    return build_tiny_model(7)


def _logits(model, ids=IDS) -> mx.array:
    return model(mx.array([ids]))[0]


def test_zero_padding_keeps_the_function():
    tiny = _tiny()
    w, cfg = pm.pad_mlp(*pm.weights_and_config(tiny), 512)
    wide = pm.model_from(w, cfg)
    assert wide.model.layers[0].mlp.gate_proj.weight.shape == (512, 64)
    assert wide.model.layers[-1].mlp.down_proj.weight.shape == (64, 512)
    assert mx.allclose(_logits(wide), _logits(tiny), atol=1e-4).item()


def test_padding_below_the_model_width_is_refused():
    with pytest.raises(pm.PairModelError, match="below"):
        pm.pad_mlp(*pm.weights_and_config(_tiny()), 64)


def test_extra_layers_at_eps_zero_are_identities():
    tiny = _tiny()
    w, cfg = pm.append_layers(*pm.weights_and_config(tiny), 3, 0.0, 0, residual=10.0)
    deep = pm.model_from(w, cfg)
    assert len(deep.model.layers) == 7 and cfg["num_hidden_layers"] == 7
    assert mx.array_equal(_logits(deep), _logits(tiny)).item()


def test_extra_layers_at_eps_above_zero_change_the_function():
    tiny = _tiny()
    r = pm.residual_rms(tiny, IDS)
    w, cfg = pm.append_layers(*pm.weights_and_config(tiny), 2, 0.5, 0, residual=r)
    assert not mx.allclose(_logits(pm.model_from(w, cfg)), _logits(tiny), atol=1e-3).item()


def test_random_layers_are_seeded():
    cfg = pm.weights_and_config(_tiny())[1]
    a, b = pm.random_layer(cfg, 1, 0, 1.0), pm.random_layer(cfg, 1, 0, 1.0)
    c = pm.random_layer(cfg, 2, 0, 1.0)
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert not mx.array_equal(a["mlp.up_proj.weight"], c["mlp.up_proj.weight"]).item()


@pytest.mark.slow
def test_a_larger_eps_lowers_agreement():
    tiny = _tiny()
    prompts = [IDS[:4], IDS[4:9], IDS[2:12], [9, 9, 4]]
    acc = []
    for eps in (0.0, 0.05, 1.0):
        w, cfg = pm.pair_weights(tiny, IDS, 256, 2, eps, 0)
        acc.append(agreement_models(pm.model_from(w, cfg), tiny, prompts, tokens=24))
    assert acc[0] == 1.0
    assert acc[0] >= acc[1] > acc[2]
    assert acc[2] < 0.8


def test_the_cache_key_names_every_parameter():
    base = dict(width=6144, extra_layers=2, eps=0.1, seed=0)
    keys = {pm.cache_key(**base)}
    for k, v in (("width", 8192), ("extra_layers", 3), ("eps", 0.1000001), ("seed", 1)):
        keys.add(pm.cache_key(**{**base, k: v}))
    assert len(keys) == 5
    assert f"f{pm.FORMAT_VERSION}" in pm.cache_key(**base)
    assert pm.pair_dir(**base).name == pm.cache_key(**base)


class _FailingTokenizer:
    class _HF:
        def save_pretrained(self, path: str) -> None:
            raise OSError("disk full")

    _tokenizer = _HF()


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path):
    w, cfg = pm.weights_and_config(_tiny())
    out = tmp_path / "v"
    with pytest.raises(OSError, match="disk full"):
        pm.write_model_dir(w, cfg, _FailingTokenizer(), out, "test")
    assert list(tmp_path.iterdir()) == []


def test_bisection_on_log_eps_finds_the_target():
    calls: list[float] = []

    def measure(eps: float) -> float:  # acceptance falling with log(eps)
        calls.append(eps)
        return 1 / (1 + math.exp(2 * (math.log(eps) - math.log(0.2))))

    s = bisect_log(measure, 0.8, 1e-3, 4.0, 10)
    assert abs(s.acceptance - 0.8) < 0.01
    assert 0.1 < s.eps < 0.15
    seen: dict[float, float] = {}
    bisect_log(measure, 0.8, 1e-3, 4.0, 4, seen)
    n = len(calls)
    bisect_log(measure, 0.8, 1e-3, 4.0, 4, seen)
    assert len(calls) == n  # the memo answers a second target's repeat points


def test_param_bytes_counts_the_weights_and_width_for_bytes_inverts_it():
    w, cfg = pm.weights_and_config(_tiny())
    assert pm.param_bytes(cfg) == sum(v.nbytes for v in w.values())
    w, cfg2 = pm.pad_mlp(*pm.append_layers(w, cfg, 2, 0.1, 0, 1.0), 1024)
    assert pm.param_bytes(cfg2) == sum(v.nbytes for v in w.values())
    wide = {**cfg, "intermediate_size": 4096}
    assert pm.width_for_bytes(cfg, pm.param_bytes(wide)) == 4096


@pytest.mark.slow
@pytest.mark.timeout(1200)  # builds and writes a 0.7 GB verifier
def test_the_wide_verifier_is_smollm2_and_mlx_lm_reads_it(tmp_path: Path, monkeypatch):
    import mlx_lm

    from macfleet.bench import pair_dial
    from macfleet.bench.pair_dial import agreement, teacher_forced_argmax
    from macfleet.engine.models import load_model
    from macfleet.engine.text import encode_prompt

    path = pm.build_pair_verifier(2048, extra_layers=1, eps=0.0, out=tmp_path / "v")
    wide, base = load_model(str(path), cached=False), load_model(pm.DRAFT_SPEC)
    assert wide.model.args.intermediate_size == 2048 and wide.num_layers == 31
    prompts = ("Explain what a rainbow is.", "List three uses of a paperclip.")
    ids = [encode_prompt(base.tokenizer, p, chat=True) for p in prompts]
    # the same next token at every prompt position (one forward each), and 8 decoded tokens
    # (32 cost 20 s of the test's ~38 s of CPU, and checked fewer positions): the wide one's
    # 8 (a KV cache, mlx-lm's batch) are what smollm2 predicts at each of them, agreement()
    # below on the same prompts; smollm2 decoding them itself went (its own greedy path)
    assert teacher_forced_argmax(wide.model, ids) == teacher_forced_argmax(base.model, ids)
    # agreement() on the directory: it asks for the verifier uncached and the draft by spec;
    # the verifier is the one loaded above (a second 0.7 GB read and eval was ~1/4 of this
    # test's CPU; that the directory loads is the load_model above)
    asked: list[tuple[str, bool]] = []

    def loaded(spec: str, *, cached: bool = True):
        asked.append((spec, cached))
        return wide if spec == str(path) else load_model(spec, cached=cached)

    monkeypatch.setattr(pair_dial, "load_model", loaded)
    assert agreement(path, prompts=prompts, tokens=8) == 1.0
    assert asked == [(str(path), False), (pm.DRAFT_SPEC, True)]
    # mlx-lm's own loader reads the directory: its config, every weight's name and shape
    # (strict), the tokenizer; lazily (the weights' values are the load_model's above, which
    # is mlx_lm.load too: engine/models.py)
    model, tok = mlx_lm.load(str(path), lazy=True)
    assert model.args.num_hidden_layers == 31 and model.args.intermediate_size == 2048
    assert tok.encode("hello") == base.tokenizer.encode("hello")


def test_bisection_stops_within_tolerance():
    calls: list[float] = []

    def measure(eps: float) -> float:
        calls.append(eps)
        return 0.81

    s = bisect_log(measure, 0.8, 0.01, 1.0, 5, tolerance=0.02)
    assert len(calls) == 1 and s.eps == pytest.approx(0.1)


def test_dial_runs_of_one_instrument_merge_by_target():
    from macfleet.cli.bench_pair_dial import merge_dial

    base = dict(extra_layers=2, seed=0, calibration_width=1536, prompts=["a"], tokens=64)
    a = {**base, "settings": [{"target": 0.8, "eps": 0.1, "acceptance": 0.79}],
         "measured": [{"eps": 0.1, "acceptance": 0.79}]}
    b = {**base, "settings": [{"target": 0.6, "eps": 0.3, "acceptance": 0.61}],
         "measured": [{"eps": 0.3, "acceptance": 0.61}]}
    m = merge_dial(a, b)
    assert [s["target"] for s in m["settings"]] == [0.6, 0.8]
    c = {**base, "settings": [{"target": 0.6, "eps": 0.5, "acceptance": 0.5}],
         "measured": [{"eps": 0.5, "acceptance": 0.5}]}
    assert merge_dial(m, c)["settings"][0]["eps"] == 0.3  # a farther point does not win
    assert [p["eps"] for p in m["measured"]] == [0.1, 0.3]
    assert merge_dial({**a, "tokens": 96}, b) == b  # another instrument: replaced


# --- the draft dial: noise on the draft's weights, the verifier untouched --------------------

def test_draft_noise_zero_keeps_the_weights():
    w, _ = pm.weights_and_config(_tiny())
    same = pm.noisy_weights(w, 0.0, 3)
    assert all(mx.array_equal(same[k], w[k]).item() for k in w)


def test_draft_noise_moves_each_matrix_by_its_own_size_and_is_seeded():
    w, _ = pm.weights_and_config(_tiny())
    a, b, c = (pm.noisy_weights(w, 0.1, s) for s in (3, 3, 4))
    for k, v in w.items():
        if v.ndim < 2:  # norms kept
            assert mx.array_equal(a[k], v).item()
            continue
        rms = math.sqrt(mx.mean(v * v).item())
        moved = math.sqrt(mx.mean((a[k] - v) ** 2).item())
        assert moved == pytest.approx(0.1 * rms, rel=0.25), k
        assert mx.array_equal(a[k], b[k]).item() and not mx.array_equal(a[k], c[k]).item()
    with pytest.raises(pm.PairModelError):
        pm.noisy_weights(w, -0.1, 0)


def test_draft_noise_lowers_agreement_with_the_untouched_verifier():
    tiny = _tiny()
    w, cfg = pm.weights_and_config(tiny)
    prompts = [IDS, IDS[::-1]]
    exact = agreement_models(tiny, pm.model_from(pm.noisy_weights(w, 0.0, 0), cfg), prompts, 24)
    noisy = agreement_models(tiny, pm.model_from(pm.noisy_weights(w, 1.0, 0), cfg), prompts, 24)
    assert exact == 1.0 and noisy < 0.9


def test_bench_pair_reads_either_dial():
    from macfleet.cli.bench_pair import dial_settings, setting_key

    doc = {"dial": {"extra_layers": 2, "seed": 0,
                    "settings": [{"target": 0.6, "eps": 0.56, "acceptance": 0.57}]},
           "draft_dial": {"seed": 1, "settings": [{"target": 0.6, "noise": 0.12,
                                                   "acceptance": 0.6}]}}
    layers, draft = dial_settings(doc, "layers")[0.6], dial_settings(doc, "draft")[0.6]
    assert (layers["eps"], layers["draft_noise"], layers["kind"]) == (0.56, 0.0, "layers")
    assert (draft["eps"], draft["draft_noise"], draft["kind"]) == (0.0, 0.12, "draft")
    assert draft["extra_layers"] == 2 and draft["seed"] == 1
    with pytest.raises(SystemExit, match="draft dial"):
        dial_settings({"dial": doc["dial"]}, "draft")
    # rows of both dials at one (width, target) are kept apart; old rows were the layer dial's
    assert setting_key({"width": 5, "target": 0.6}) == (5, 0.6, "layers")
    assert setting_key({"width": 5, "target": 0.6, "dial_kind": "draft"}) != (5, 0.6, "layers")
