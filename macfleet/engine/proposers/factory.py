"""Proposer specs: `none`, `ngram[:N]`, `layerskip:K`, `draft:<model spec>`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from macfleet.engine.models import LoadedModel, ModelSpecError, load_model
from macfleet.engine.proposers.base import Proposer
from macfleet.engine.proposers.model_draft import LayerSkipModel, ModelProposer
from macfleet.engine.proposers.ngram import DEFAULT_MAX_NGRAM, NgramProposer


class ProposerSpecError(ValueError):
    """A proposer spec that cannot be built for this verifier (the message says why)."""


@dataclass(frozen=True)
class ProposerSpec:
    kind: str  # none | ngram | layerskip | draft
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


KINDS = ("none", "ngram", "layerskip", "draft", "eagle", "eagle2", "retrieval")
TREE_KINDS = ("eagle2", "retrieval")  # drafters whose proposals are token trees (drafts_trees)


def parse_proposer_spec(spec: str) -> ProposerSpec:
    kind, _, arg = (spec or "").strip().partition(":")
    if kind not in KINDS:
        raise ProposerSpecError(
            f"unknown proposer '{spec}': use none, ngram[:N], layerskip:K, draft:MODEL, "
            "eagle[:PATH] (chains), eagle2[:PATH] (dynamic trees) or retrieval[:PATH]"
        )
    if kind in ("ngram", "layerskip") and arg and not arg.isdigit():
        raise ProposerSpecError(f"'{spec}': the argument of {kind} must be a whole number")
    if kind == "layerskip" and not arg:
        raise ProposerSpecError(f"'{spec}': layerskip needs an argument (layerskip:K)")
    if kind == "none" and arg:
        raise ProposerSpecError(f"'{spec}': none takes no argument")
    return ProposerSpec(kind, arg)


def drafts_tree(spec: str) -> bool:
    """Whether `spec` drafts a token tree each block (several drafters, or a tree drafter),
    from the spec alone: a verifier routes a remote drafter it never builds as a local one."""
    parts = spec.split("+")
    return len(parts) > 1 or parse_proposer_spec(parts[0]).kind in TREE_KINDS


def make_proposer(spec: str, verifier: LoadedModel) -> Proposer | None:
    """Build the proposer named by `spec` for this verifier (None for `none`)."""
    ps = parse_proposer_spec(spec)
    if ps.kind == "none":
        return None
    if ps.kind == "ngram":
        n = int(ps.arg) if ps.arg else DEFAULT_MAX_NGRAM
        if not 1 <= n <= 8:
            raise ProposerSpecError(f"ngram size must be 1..8, got {n}")
        return NgramProposer(max_n=n)
    if ps.kind == "retrieval":
        from macfleet.engine.proposers.retrieval import make_retrieval_proposer

        return make_retrieval_proposer(ps.arg, verifier, ProposerSpecError)
    if ps.kind in ("eagle", "eagle2"):
        from macfleet.engine.proposers.eagle.load import make_eagle_proposer

        return make_eagle_proposer(ps.arg, verifier, ProposerSpecError,
                                   tree=ps.kind == "eagle2")
    if ps.kind == "draft" and not ps.arg:
        raise ProposerSpecError("'draft' alone drafts on a fleet's draft-model agent (started "
                                "with `agent --role proposer --draft MODEL`); in one process "
                                "name the model: draft:MODEL")
    if ps.kind == "layerskip":
        k = int(ps.arg)
        if not 1 <= k < verifier.num_layers:
            raise ProposerSpecError(
                f"layerskip:{k}: depth must be 1..{verifier.num_layers - 1} for "
                f"{verifier.spec} ({verifier.num_layers} layers)"
            )
        return ModelProposer(LayerSkipModel(verifier.model, k), name=f"layerskip:{k}")
    return draft_model_proposer(ps.arg, verifier)


def draft_model_proposer(model: str, verifier: LoadedModel,
                         load: Callable[[str], LoadedModel] = load_model) -> ModelProposer:
    """`draft:MODEL`: a separate small model, which must share the verifier's tokenizer
    (`load` builds it: an agent's bounded cache of draft models)."""
    try:
        draft = load(model)
    except ModelSpecError as e:
        raise ProposerSpecError(f"draft model: {e}") from e
    if draft.vocab_size != verifier.vocab_size:
        raise ProposerSpecError(
            f"draft model {model} has vocabulary {draft.vocab_size}, the verifier "
            f"{verifier.vocab_size}: a draft model must share the verifier's tokenizer"
        )
    return ModelProposer(draft.model, name=f"draft:{model}")
