"""What a verifier's request drafting builds for remote proposers (built only, never
connected): an EAGLE drafter given this verifier's real hidden states (F3) sends no F3 probe
beside them, on a chain or as a member of a tree; a drafter without them is probed."""

from __future__ import annotations

import pytest

from agents.specs import DraftModels, SpecPolicy
from agents.verifier_drafting import RequestDrafting, probed
from bridge.messages import GenerateRequest
from macfleet.engine.models import load_model
from macfleet.engine.verifier import Verifier

ENDPOINTS = ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]


@pytest.fixture(scope="module")
def drafts():
    lm = load_model("tiny:1")
    return RequestDrafting(lm, key=b"d" * 32, policy=SpecPolicy(own_model=lm.spec),
                           models=DraftModels(), verifier=Verifier(lm.model),
                           f3_probe_width=lm.hidden_size)


def _msg(spec: str) -> GenerateRequest:
    return GenerateRequest("r", "hi", False, 8, 0.0, 1.0, None, 4, ENDPOINTS, spec, True)


@pytest.mark.parametrize("batched", [False, True])
def test_a_drafter_fed_real_features_is_not_probed_chain_or_tree(drafts, batched):
    chain = drafts.fallback(_msg("eagle"), batched).remotes
    drafts.close_tap()
    tree = drafts.tree_group(_msg("eagle+ngram"), ["eagle", "ngram"], batched).proposers
    drafts.close_tap()
    assert [p.features is not None for p in [*chain, *tree]] == [True, True, True, False]
    assert [p.f3_probe_width for p in [*chain, *tree]] == [0, 0, 0, drafts.f3_probe_width]


def test_block_metrics_call_f3_a_probe_only_where_a_remote_proposer_sends_one(drafts):
    eagle = drafts.fallback(_msg("eagle"), True)
    tree = drafts.tree_group(_msg("eagle+ngram"), ["eagle", "ngram"], True)
    ngram = drafts.fallback(_msg("ngram"))
    local = drafts.drafting(GenerateRequest("r", "hi", False, 8, 0.0, 1.0, None, 4, [],
                                            "ngram", True))
    assert [probed(d) for d in (eagle, tree, ngram, local)] == [False, True, True, False]
