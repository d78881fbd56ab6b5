"""A verifier that breaks mid-generation: the CLI re-plans onto another verifier and continues
after the tokens already committed -- nothing lost, nothing repeated."""

from __future__ import annotations

import argparse
import json

import pytest

from agents.daemon import Agent, AgentConfig
from agents.verifier_service import VerifierLost
from macfleet.cli import cmd_generate
from macfleet.engine.events import Finished
from reference_loops import speculative_generate
from macfleet.engine.models import load_model
from macfleet.engine.verifier import Verifier
from macfleet.fleet import client

KEY = b"r" * 32
LOCAL = ("tcp://127.0.0.1:*",)  # in-process agents do not advertise: their peers are allowed
MODEL = "tiny:8"


class BreaksAfter(Verifier):
    """A verifier that loses its hardware (a shard rank) after n forwards."""

    def __init__(self, model, n: int) -> None:
        super().__init__(model)
        self.left = n

    def forward(self, tokens):
        self.left -= 1
        if self.left < 0:
            raise VerifierLost("rank 1 vanished")
        return super().forward(tokens)


@pytest.mark.slow
def test_replan_continues_after_committed_tokens(monkeypatch, capsys):
    lm = load_model(MODEL)
    bad = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                            allow_peers=LOCAL))
    bad.verifier.close()
    bad.verifier = bad._verifier_service(BreaksAfter(lm.model, 12))
    good = Agent(AgentConfig(role="verifier", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL))
    prop = Agent(AgentConfig(role="proposer", model=MODEL, key=KEY, advertise=False,
                             allow_peers=LOCAL))
    try:
        cards = [bad.card, good.card, prop.card]
        monkeypatch.setattr(client, "members", lambda *a, **k: list(cards))
        real_probe = client.probe

        def probe(card, key, **kw):  # the broken verifier looks best: it is chosen first
            st = real_probe(card, key, **kw)
            fast = card.node_id == bad.node_id
            return client.AgentStatus(st.card, st.status, (0.01,) if fast else (50.0,))

        monkeypatch.setattr(client, "probe", probe)
        args = argparse.Namespace(
            prompt="the cat sat on the mat", model=MODEL, proposer="ngram", draft_tokens="2",
            max_tokens=60, temp=0.0, top_p=1.0, seed=None, no_chat=True, json=True,
            local=False, no_cross_round=False, key=None, open=False, wait=0.1,
            response_format=None)
        monkeypatch.setattr("macfleet.fleet.keys.resolve_key", lambda *a, **k: KEY)
        assert cmd_generate.run(args) == 0
        captured = capsys.readouterr()
        doc = json.loads(captured.out)
        assert "re-planning" in captured.err
        ref = [e for e in speculative_generate(Verifier(lm.model), None,
                                               lm.tokenizer.encode("the cat sat on the mat"),
                                               max_tokens=60) if isinstance(e, Finished)][0]
        assert doc["token_ids"] == list(ref.token_ids) and len(doc["token_ids"]) == 60
        assert doc["stats"]["fleet"]["verifier_agent"] == good.name
        # where it ran, on stderr before each verifier's tokens and in the stats: the agents
        # chosen first, then the ones after the re-plan
        placed = [ln for ln in captured.err.splitlines() if ln.startswith("macfleet: fleet ")]
        assert [f"verifier {bad.name} " in placed[0], f"verifier {good.name} " in placed[1]] == [
            True, True], captured.err
        assert all(f"proposers {prop.name}" in ln for ln in placed)
        where = doc["stats"]["where"]
        assert (where["mode"], where["verifier"], where["proposers"]) == (
            "fleet", good.name, [prop.name])
    finally:
        for a in (bad, good, prop):
            a.close()
