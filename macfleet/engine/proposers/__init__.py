"""Draft sources. Every proposer implements `Proposer` (base.py); `make_proposer` builds one."""

from macfleet.engine.proposers.base import Draft, Proposer
from macfleet.engine.proposers.factory import (ProposerSpecError, drafts_tree, make_proposer,
                                               parse_proposer_spec)

__all__ = ["Draft", "Proposer", "ProposerSpecError", "drafts_tree", "make_proposer",
           "parse_proposer_spec"]
