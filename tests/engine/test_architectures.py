"""Which architectures the token-tree and flat batched forwards run, and that they run them
exactly as the model's own forward does (engine/tree_verify.py `supports_tree_attention`).

Tiny random models of mlx-lm's own classes: Qwen3 (each head's queries and keys normalised
before the rotation), which they run; OLMo2 (norms after the attention and the MLP) and Gemma3
(norms around the MLP, scaled embeddings), which they do not compute and must refuse rather
than run wrong. Qwen3 through the serving engine gives the ids of plain decoding (greedy margin rule of
tests/tolerance.py: random weights, several kernels).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_testkit import finished, mlx_lm_greedy
from mlx.utils import tree_map
from mlx_lm.models import gemma3_text, olmo2, qwen2, qwen3

from macfleet.engine import tree_verify
from macfleet.engine.batch import BatchUnsupported, check_batchable
from macfleet.engine.sampling import GREEDY
from macfleet.serve.engine import BatchEngine, EngineRequest

VOCAB = 96
COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
              vocab_size=VOCAB, max_position_embeddings=512, rope_theta=10000.0)


def build(module, seed: int = 0, common=COMMON, **extra):
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(model_type=module.__name__.rsplit(".", 1)[1],
                                          **common, **extra))
    # sharper than the default init, so the probe's logits are far from uniform
    model.update(tree_map(lambda p: p * 3.0, model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model


def qwen3_model(seed: int = 0):
    return build(qwen3, seed, tie_word_embeddings=True)


def qwen2_model(seed: int = 0):  # biased q/k/v projections, no head_dim field
    return build(qwen2, seed, {k: v for k, v in COMMON.items() if k != "head_dim"},
                 tie_word_embeddings=True)


def olmo2_model(seed: int = 0):
    return build(olmo2, seed, tie_word_embeddings=True)


def gemma3_model(seed: int = 0):
    return build(gemma3_text, seed, query_pre_attn_scalar=16.0, sliding_window=512)


@pytest.mark.parametrize("make", [qwen3_model, qwen2_model], ids=["qwen3", "qwen2"])
def test_query_key_norms_are_applied_and_the_probe_accepts(make):
    model = make()
    assert tree_verify.supports_tree_attention(model)
    check_batchable(model)


@pytest.mark.parametrize("make", [olmo2_model, gemma3_model], ids=["olmo2", "gemma3"])
def test_an_architecture_these_forwards_do_not_compute_is_refused_not_run_wrong(make):
    model = make()
    # llama-shaped parts (q/k/v/o, rope, mlp): only the probe tells it apart
    a = model.layers[0].self_attn
    assert all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"))
    assert not tree_verify.supports_tree_attention(model)
    with pytest.raises(BatchUnsupported):
        check_batchable(model)


def test_the_probe_runs_once_per_model(monkeypatch):
    model = qwen3_model(seed=3)
    calls = []
    real = tree_verify._agrees_with_model
    monkeypatch.setattr(tree_verify, "_agrees_with_model",
                        lambda m: calls.append(1) or real(m))
    assert tree_verify.supports_tree_attention(model)
    assert tree_verify.supports_tree_attention(model)
    assert len(calls) == 1


def test_qwen3_through_the_serving_engine_gives_plain_decodings_ids():
    model = qwen3_model(seed=1)
    prompt = [5, 17, 33, 2, 9, 41, 5, 17]

    class LM:  # the parts of a LoadedModel the engine reads
        vocab_size, tokenizer, eos_ids = VOCAB, None, frozenset()

    lm = LM()
    lm.model = model
    out: list = []
    engine = BatchEngine(lm, proposer="ngram")
    engine.submit(EngineRequest(tuple(prompt), GREEDY, 24), out.append)
    engine.run_until_idle()
    assert list(finished(out).token_ids) == mlx_lm_greedy(model, prompt, 24)


def test_a_verifier_without_a_kv_cache_here_verifies_branches_and_never_probes(monkeypatch):
    """A sharded verifier's layers run on other ranks: its model's forward on this rank alone
    would wait for them forever, so the probe must not run it (agents/shard.py)."""
    from macfleet.engine import tree_loop
    from macfleet.engine.models import load_model
    from macfleet.engine.proposers import make_proposer
    from macfleet.engine.proposers.group import make_group
    from macfleet.engine.verifier import Verifier

    lm = load_model("tiny:2")

    class Remote:  # the Verifier interface, its cache elsewhere (as ShardedVerifier)
        def __init__(self, model):
            self._v, self.model = Verifier(model), model
            self.prefill, self.forward, self.rollback, self.reset = (
                self._v.prefill, self._v.forward, self._v.rollback, self._v.reset)

        @property
        def offset(self):
            return self._v.offset

    probed = []
    monkeypatch.setattr(tree_loop, "supports_tree_attention",
                        lambda model: probed.append(model) or True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    group = make_group([make_proposer("ngram", lm), make_proposer("ngram:2", lm)], 4)
    got = finished(tree_loop.tree_generate(Remote(lm.model), group, prompt, max_tokens=16))
    assert probed == []
    assert list(got.token_ids) == mlx_lm_greedy(lm.model, prompt, 16)
