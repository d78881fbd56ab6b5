"""A request's prediction joined to a verifier agent's remote token tree (`a+b` on proposer
agents): the tree's flow figures and failures are its remote proposers' only."""

from __future__ import annotations

from agents.remote_proposer import RemoteProposer
from agents.remote_tree import RemoteProposerGroup
from agents.verifier_drafting import last_flows
from macfleet.engine.proposers.prediction import PredictionProposer
from macfleet.serve.drafting import with_prediction
from macfleet.stats import FlowStats


def test_a_remote_tree_with_a_prediction_reports_its_remote_flows_only():
    remotes = [RemoteProposer(f"tcp://127.0.0.1:{port}", key=None, proposer="ngram",
                              model="tiny:1") for port in (1, 2)]
    group = RemoteProposerGroup(remotes, node_budget=16)
    pred = PredictionProposer((1, 2, 3), 5)
    joined = with_prediction(group, pred, "auto")
    assert joined is group and group.proposers[-1] is pred and group.node_budget == 16 + 64
    assert group.remotes == remotes
    assert isinstance(group.flow_stats(), FlowStats)  # the prediction has no flows
    assert last_flows(group) is None  # no remote block yet
    group._fail(len(group.proposers) - 1, RuntimeError("x"))
    assert group.failures == ["prediction: x"]
