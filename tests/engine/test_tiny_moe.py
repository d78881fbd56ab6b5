"""The tiny mixture of experts (`tiny-moe:SEED`) as a verifier.

It is mlx-lm's own qwen3_moe class with tiny dims and random weights, deterministic from the
seed. Speculative decoding over it is bit-identical in greedy to mlx-lm's plain decoding of the
same model, with drafts that are mostly rejected (ngram on a random model: rollbacks) and drafts
that are all accepted (the model as its own draft: multi-token blocks); the CLI's in-process
`generate --local --proposer ngram` prints the same ids.

Token ids: the "greedy margin" rule of tests/tolerance.py (blocks vs plain decoding).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from engine_testkit import finished, mlx_lm_greedy
from mlx.utils import tree_flatten

from macfleet.engine.models import ModelSpecError, load_model
from macfleet.engine.proposers import make_proposer
from macfleet.serve.one import decode_ids

SPEC = "tiny-moe:1"
MAX_TOKENS = 24
PROMPT = "one two three, one two three, one two three,"


@pytest.fixture(scope="module")
def moe():
    return load_model(SPEC)


@pytest.fixture(scope="module")
def reference(moe):
    ids = moe.tokenizer.encode(PROMPT)
    return ids, mlx_lm_greedy(moe.model, ids, MAX_TOKENS)


def test_is_an_mlx_lm_moe_deterministic_from_seed(moe):
    from mlx_lm.models import qwen3_moe

    assert isinstance(moe.model, qwen3_moe.Model)
    assert moe.model.args.num_experts == 8 and moe.model.args.num_experts_per_tok == 2
    assert moe.num_layers == 4
    again = dict(tree_flatten(load_model(SPEC, cached=False).model.parameters()))
    other = dict(tree_flatten(load_model("tiny-moe:2", cached=False).model.parameters()))
    for name, w in tree_flatten(moe.model.parameters()):
        assert mx.array_equal(w, again[name]), name
    assert not mx.array_equal(moe.model.model.layers[0].mlp.gate.weight,
                              other["model.layers.0.mlp.gate.weight"])


def test_routes_tokens_to_several_experts(moe, reference):
    ids, _ = reference
    x = moe.model.model.embed_tokens(mx.array(ids)[None])
    layer = moe.model.model.layers[0]
    gates = layer.mlp.gate(layer.post_attention_layernorm(x))
    top = np.argsort(np.array(gates[0]), axis=-1)[:, -2:]
    assert len(np.unique(top)) >= 4  # a router that sends everything to one expert tests little


@pytest.mark.parametrize("spec", ["ngram", f"draft:{SPEC}", "none"])
def test_spec_decode_greedy_identical(moe, reference, spec):
    ids, want = reference
    prop = make_proposer(spec, moe)
    fin = finished(decode_ids(moe, ids, prop, draft_tokens=4 if prop else 0,
                              max_tokens=MAX_TOKENS, eos_ids=frozenset()))
    assert list(fin.token_ids) == want
    if spec.startswith("draft"):
        assert fin.stats.accepted >= MAX_TOKENS // 2  # multi-token blocks were committed


def test_bad_spec_is_named():
    with pytest.raises(ModelSpecError, match="tiny-moe"):
        load_model("tiny-moe:x")


@pytest.mark.slow  # runs the CLI in a subprocess
def test_cli_generate_local_ngram(reference):
    ids, want = reference
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-m", "macfleet", "generate", "--local", "--model", SPEC,
         "--proposer", "ngram", "--no-chat", "--json", "--max-tokens", str(MAX_TOKENS), PROMPT],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["token_ids"] == want
    assert res["stats"]["drafted"] > 0
