"""Which architectures the token-tree and flat batched forwards run, and that they run them
exactly as the model's own forward does (engine/tree_verify.py `supports_tree_attention`).

Tiny random models of mlx-lm's own classes: Qwen3 (each head's queries and keys normalised
before the rotation), which they run; OLMo2 (norms after the attention and the MLP) and Gemma3
(norms around the MLP, scaled embeddings), which they do not compute and must refuse rather
than run wrong. Qwen3 through the serving engine gives the ids of plain decoding (greedy margin rule of
tests/tolerance.py: random weights, several kernels); OLMo2 and Gemma3 go through it on their
own forward (its batch-invariant mode), as does a verifier whose layers run elsewhere (a
sharded one), and give plain decoding's ids exactly.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_testkit import finished, mlx_lm_greedy
from mlx.utils import tree_map
from mlx_lm.models import gemma3_text, olmo2, qwen2, qwen3

from macfleet.engine import tree_verify
from macfleet.engine.proposers import make_proposer
from macfleet.engine.sampling import GREEDY
from macfleet.engine.verifier import Verifier
from macfleet.serve import engine as serve_engine
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


@pytest.mark.parametrize("make", [olmo2_model, gemma3_model], ids=["olmo2", "gemma3"])
def test_an_architecture_these_forwards_do_not_compute_is_refused_not_run_wrong(make):
    model = make()
    # llama-shaped parts (q/k/v/o, rope, mlp): only the probe tells it apart
    a = model.layers[0].self_attn
    assert all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"))
    assert not tree_verify.supports_tree_attention(model)


def test_the_probe_runs_once_per_model(monkeypatch):
    model = qwen3_model(seed=3)
    calls = []
    real = tree_verify._agrees_with_model
    monkeypatch.setattr(tree_verify, "_agrees_with_model",
                        lambda m: calls.append(1) or real(m))
    assert tree_verify.supports_tree_attention(model)
    assert tree_verify.supports_tree_attention(model)
    assert len(calls) == 1


class LM:  # the parts of a LoadedModel the engine reads
    vocab_size, tokenizer, eos_ids = VOCAB, None, frozenset()

    def __init__(self, model):
        self.model = model


def test_qwen3_through_the_serving_engine_gives_plain_decodings_ids():
    model = qwen3_model(seed=1)
    prompt = [5, 17, 33, 2, 9, 41, 5, 17]
    lm = LM(model)
    out: list = []
    engine = BatchEngine(lm, proposer="ngram")
    assert not engine.invariant
    engine.submit(EngineRequest(tuple(prompt), GREEDY, 24), out.append)
    engine.run_until_idle()
    assert list(finished(out).token_ids) == mlx_lm_greedy(model, prompt, 24)


def gemma3_run_model(seed: int = 0):  # its sliding-window layers within the two it has
    return build(gemma3_text, seed, query_pre_attn_scalar=16.0, sliding_window=512,
                 sliding_window_pattern=2)


# (a tree's drafters are sized by verify(L), whose table is keyed by a fingerprint that reads
# llama's `input_layernorm`: OLMo2, which has none, runs chains)
@pytest.mark.slow
@pytest.mark.parametrize("make, spec", [(olmo2_model, "ngram"), (gemma3_run_model, "ngram"),
                                        (gemma3_run_model, "ngram+ngram:2")],
                         ids=["olmo2", "gemma3", "gemma3-tree"])
def test_an_architecture_the_flat_batch_cannot_run_decodes_on_its_own_forward(make, spec):
    """Refused by the flat batch, run by the engine all the same: each block the model's own
    forward (a `Verifier` per session; a tree branch by branch), so greedy ids are plain
    decoding's, exactly."""
    model = make(seed=2)
    prompt = [5, 17, 33, 2, 9, 41, 5, 17, 33, 2, 9]
    out: list = []
    engine = BatchEngine(LM(model), proposer=spec)
    assert engine.invariant and engine.kv_store is None
    engine.submit(EngineRequest(tuple(prompt), GREEDY, 24), out.append)
    engine.run_until_idle()
    fin = finished(out)
    assert list(fin.token_ids) == mlx_lm_greedy(model, prompt, 24)
    assert fin.stats.drafted > 0  # blocks of several tokens were verified


def test_trees_in_the_batch_invariant_mode_are_verified_in_one_forward(monkeypatch):
    """A llama-style model in the batch-invariant mode: a tree in ONE forward of the session's
    own verifier (`tree_forward`, then its path kept in place), not branch by branch."""
    from macfleet.engine import tree_verify
    from macfleet.engine.models import load_model

    lm = load_model("tiny:2")
    branches = []
    real = tree_verify.branch_rows
    monkeypatch.setattr(tree_verify, "branch_rows", lambda *a: branches.append(1) or real(*a))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9]
    out: list = []
    engine = BatchEngine(lm, proposer="ngram+ngram:2", invariant=True)
    engine.submit(EngineRequest(tuple(prompt), GREEDY, 24), out.append)
    engine.run_until_idle()
    fin = finished(out)
    assert branches == [] and fin.stats.drafted > 0
    assert list(fin.token_ids) == mlx_lm_greedy(lm.model, prompt, 24)


def test_a_verifier_whose_layers_run_elsewhere_serves_the_engine_unprobed(monkeypatch):
    """A sharded verifier (agents/shard.py) keeps no cache here and its model must not run
    on this rank alone: the engine runs every block through the verifier's forward, one
    session at a time, and never probes the model."""
    from macfleet.engine.models import load_model

    lm = load_model("tiny:2")

    class Remote(Verifier):  # the Verifier interface, its cache elsewhere (as ShardedVerifier)
        def __init__(self, model):
            self._v, self.model, self.calls = Verifier(model), model, 0

        def forward(self, tokens):
            self.calls += 1
            return self._v.forward(tokens)

        @property
        def offset(self):
            return self._v.offset

        def prefill(self, tokens):
            self._v.prefill(tokens)

        def rollback(self, n):
            self._v.rollback(n)

        def reset(self):
            self._v.reset()

    from macfleet.engine import tree_verify
    from macfleet.engine.proposers.group import make_group

    probed = []
    for where in (serve_engine, tree_verify):
        monkeypatch.setattr(where, "supports_tree_attention",
                            lambda model: probed.append(model) or True)
    with pytest.raises(ValueError, match="one at a time"):
        BatchEngine(lm, proposer="none", verifier=Remote(lm.model))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    for drafting in (make_proposer("ngram", lm),  # a chain; a tree, branch by branch
                     make_group([make_proposer("ngram", lm), make_proposer("ngram:2", lm)], 4)):
        v = Remote(lm.model)
        engine = BatchEngine(lm, proposer="none", max_active=1, verifier=v)
        out: list = []
        engine.submit(EngineRequest(tuple(prompt), GREEDY, 16), out.append, proposer=drafting)
        engine.run_until_idle()
        fin = finished(out)
        assert probed == [] and engine.invariant
        assert list(fin.token_ids) == mlx_lm_greedy(lm.model, prompt, 16)
        assert v.calls >= fin.stats.blocks and fin.stats.drafted > 0


def test_a_verifier_without_a_kv_cache_here_verifies_branches_and_never_probes(monkeypatch):
    """A sharded verifier's layers run on other ranks: its model's forward on this rank alone
    would wait for them forever, so the probe must not run it (agents/shard.py)."""
    import reference_loops as tree_loop
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
