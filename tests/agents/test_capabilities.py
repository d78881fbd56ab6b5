"""Capabilities are declared on the protocols, not probed: a verifier says whether it must be
called while idle (a shard group's watchdogs), a proposer whether it drafts trees or reads the
verifier's hidden states (engine/verifier.py, engine/proposers/base.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sourcescan import nodes, product_files

from agents.shard import ShardedVerifier
from macfleet.engine.proposers.base import Proposer
from macfleet.engine.verifier import Verifier

ROOT = Path(__file__).resolve().parents[2]
CAPABILITIES = {"keepalive", "needs_keepalive", "feed_features", "wants_features",
                "drafts_trees", "fallback_tokens", "wants_lookahead", "rows", "share_rows",
                "draft_together"}


def test_verifier_capabilities_are_declared():
    assert Verifier.needs_keepalive is False and callable(Verifier.keepalive)
    assert issubclass(ShardedVerifier, Verifier) and ShardedVerifier.needs_keepalive is True


def test_proposer_capabilities_are_declared():
    assert (Proposer.drafts_trees, Proposer.wants_features, Proposer.fallback_tokens) == \
        (False, False, 0)
    assert Proposer.rows is None and callable(Proposer.share_rows)  # drafted alone by default
    assert callable(Proposer.draft_together)


@pytest.mark.slow
def test_no_capability_is_probed_by_name():
    """No hasattr/getattr(x, "<capability>") anywhere in the product."""
    probes = []
    for path in product_files():
        for node in nodes(path):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in CAPABILITIES):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not probes, probes
