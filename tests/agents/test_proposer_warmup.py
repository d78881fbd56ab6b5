"""A proposer agent is ready when its drafters are: the answer store's index is built first."""

from macfleet.engine.models import load_model


def test_a_proposer_agent_builds_the_index_before_it_serves(monkeypatch):
    import macfleet.engine.proposers.retrieval as r
    from agents.proposer_service import ProposerService

    warmed = []
    monkeypatch.setattr(r, "warm_store", lambda spec: warmed.append(spec) or True)
    lm = load_model("tiny:1:32")
    ProposerService(lm, kinds=("ngram",)).close()
    assert warmed == []  # an agent that may not serve retrieval builds nothing
    ProposerService(lm).close()
    assert warmed == [lm.spec]
