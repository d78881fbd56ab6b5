"""The verifier's draft deadline is an agent option (`macfleet agent --draft-timeout`): every
remote proposer a request's drafting builds, chain or tree, gives a draft up after it. The test
bed's link cut (tests/testbed/test_multihost.py) sets it shorter than the default."""

from __future__ import annotations

import pytest

from agents.daemon import Agent, AgentConfig
from agents.remote_proposer import DEFAULT_DRAFT_TIMEOUT_S
from bridge.messages import GenerateRequest
from macfleet.cli.common import UserError
from macfleet.cli.main import build_parser

KEY = b"d" * 32
ENDPOINTS = ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]  # never connected to: built only


def _deadlines(agent: Agent) -> list[float]:
    msg = GenerateRequest("r", "hi", False, 8, 0.0, 1.0, None, 4, ENDPOINTS, "ngram", True)
    drafts = agent.verifier.generations.drafts
    chain = drafts.fallback(msg).remotes
    tree = drafts.tree_group(msg, ["ngram", "ngram"]).proposers
    return [p.draft_timeout_s for p in [*chain, *tree]]


@pytest.mark.parametrize("given", [None, 1.25])
def test_every_remote_proposer_of_a_request_has_the_agents_draft_deadline(given):
    agent = Agent(AgentConfig(role="verifier", model="tiny:1", key=KEY, advertise=False,
                              draft_timeout_s=given))
    try:
        want = DEFAULT_DRAFT_TIMEOUT_S if given is None else given
        assert _deadlines(agent) == [want] * 4
    finally:
        agent.close()


def test_the_cli_option_reaches_the_config_and_is_bounded():
    from macfleet.cli.cmd_fleet import check_draft_timeout

    args = build_parser().parse_args(["agent", "--role", "verifier", "--draft-timeout", "2"])
    assert args.draft_timeout == 2.0
    assert check_draft_timeout(2.0) == 2.0
    for bad in (0.0, -1.0, 601.0):
        with pytest.raises(UserError, match="--draft-timeout"):
            check_draft_timeout(bad)
