"""The checks of what a request from the network names (ids, token ids, sampling, drafter
specs), and the bounded draft-model cache.

A request from the network must not make an agent open files, probe paths or download models
of the sender's choosing: every spec goes through `check_spec` with the agent's `SpecPolicy`
(docs/agents.md, "specs.py"), `local_spec` turns the checked names into what the engine loads,
and `DraftModels` keeps a bounded LRU of loaded draft models.
"""

from __future__ import annotations

import collections
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from bridge.errors import BAD_REQUEST, ProtocolError

FILE_KINDS = ("eagle", "eagle2", "retrieval")  # the argument names a file
ALLOWED_MODELS = ("smollm2", "smollm2:dense", "smollm2:q")
_TINY = re.compile(r"tiny:\d{1,6}(:\d{1,6})?")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,95}")
DEFAULT_MAX_DRAFT_MODELS = 2
MAX_SPEC_CHARS = 512
MAX_SPEC_PARTS = 8
MAX_ID_CHARS = 128  # a session or request id a request names


def check_id(value: object, what: str) -> None:
    """ProtocolError(bad_request) unless `value` is an id string of 1..MAX_ID_CHARS."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise _refuse(f"{what} must be a string of 1..{MAX_ID_CHARS} characters")


def check_tokens(ids, vocab: int, what: str) -> None:
    """ProtocolError(bad_request) unless every id of `ids` is in the vocabulary."""
    if any(not 0 <= t < vocab for t in ids):
        raise _refuse(f"{what} ids outside the vocabulary (0..{vocab - 1})")


def check_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    """ProtocolError(bad_request) unless they make `SamplingParams`."""
    from macfleet.engine.sampling import SamplingParams

    try:
        SamplingParams(temperature, top_p, seed)
    except ValueError as e:
        raise _refuse(str(e)) from None


# every drafter kind a proposer agent serves unless started with fewer (`--proposer-kinds`)
PROPOSER_KINDS = ("layerskip", "ngram", "draft", "eagle", "eagle2", "retrieval")


@dataclass(frozen=True)
class SpecPolicy:
    kinds: tuple[str, ...] = ("none", *PROPOSER_KINDS)
    heads_dir: str | None = None  # the agent's own directory of heads, stores, draft models
    own_model: str = ""  # the agent's model spec, always allowed as a draft
    allow_hub: bool = False  # Hugging Face ids for draft: (downloads) from remote requests
    vocab_size: int = 0  # the agent's model's vocabulary (0: unknown): a draft model must share it


def _refuse(why: str) -> ProtocolError:
    return ProtocolError(BAD_REQUEST, why)


def _inside(base_dir: str | None, name: str, what: str) -> Path:
    if base_dir is None:
        raise _refuse(f"this agent serves no {what} by name (start it with --heads DIR)")
    if not _plain(name):
        raise _refuse(f"{what} '{name}' must be a plain name inside the agent's heads directory")
    base = Path(base_dir).resolve()
    target = (base / name).resolve()
    if base not in target.parents:
        raise _refuse(f"{what} '{name}' is outside the agent's heads directory")
    return target


def check_spec(spec: str, policy: SpecPolicy) -> None:
    """Raise ProtocolError(bad_request) unless every part of `spec` (a+b+...) is allowed.

    Pure apart from resolving paths inside the heads directory (symlinks out are refused)."""
    from macfleet.engine.proposers import ProposerSpecError, parse_proposer_spec

    if not isinstance(spec, str) or len(spec) > MAX_SPEC_CHARS:
        raise _refuse(f"a proposer spec is a string of at most {MAX_SPEC_CHARS} characters")
    parts = spec.split("+") if spec else ["none"]
    if len(parts) > MAX_SPEC_PARTS:
        raise _refuse(f"at most {MAX_SPEC_PARTS} drafters per spec")
    for part in parts:
        try:
            ps = parse_proposer_spec(part)
        except ProposerSpecError as e:
            raise _refuse(str(e)) from None
        if ps.kind not in policy.kinds:
            raise _refuse(f"this agent serves {policy.kinds}, not {ps.kind}")
        if ps.kind in FILE_KINDS and ps.arg:
            _inside(policy.heads_dir, ps.arg, "draft head")
        if ps.kind == "draft":
            _check_draft_model(ps.arg, policy)


def _plain(name: str) -> bool:
    return bool(name) and not name.startswith(("/", "~")) and "\\" not in name \
        and "\0" not in name and all(part not in ("..", "", ".") for part in name.split("/"))


def _check_draft_model(arg: str, policy: SpecPolicy) -> None:
    if not arg:
        raise _refuse("'draft' alone drafts on a draft-model agent (`agent --role proposer "
                      "--draft MODEL`): name one among the request's proposers, or name the "
                      "model here (draft:MODEL)")
    if _TINY.fullmatch(arg):
        from macfleet.engine.tiny import DEFAULT_TINY_VOCAB

        vocab = int(arg.split(":")[2]) if arg.count(":") == 2 else DEFAULT_TINY_VOCAB
        if policy.vocab_size and vocab != policy.vocab_size:  # refused before it is built
            raise _refuse(f"draft model '{arg}' has vocabulary {vocab}, this agent's model "
                          f"{policy.vocab_size}: it must share the tokenizer")
        return
    if arg in ALLOWED_MODELS or arg == policy.own_model:
        return
    if policy.heads_dir is not None and _plain(arg) and _inside(policy.heads_dir, arg,
                                                                "draft model").exists():
        return
    if policy.allow_hub and _HUB_ID.fullmatch(arg) and _plain(arg):
        return
    raise _refuse(f"draft model '{arg}' is not allowed here: use smollm2, tiny:SEED, the agent's "
                  "own model or a model in its --heads DIR (Hugging Face ids need --allow-hub)")


def local_spec(spec: str, policy: SpecPolicy) -> str:
    """A checked spec with names in the heads directory replaced by their paths."""
    out = []
    for part in (spec or "none").split("+"):
        kind, _, arg = part.partition(":")
        inside = policy.heads_dir is not None and _plain(arg) and (
            kind in FILE_KINDS or (kind == "draft" and (Path(policy.heads_dir) / arg).exists()))
        out.append(f"{kind}:{(Path(policy.heads_dir) / arg).resolve()}" if inside else part)
    return "+".join(out)


class DraftModels:
    """An LRU of loaded draft models (thread-safe); the agent's own model is never counted."""

    def __init__(self) -> None:
        self.max_models = DEFAULT_MAX_DRAFT_MODELS
        self._lru: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, spec: str, own):
        """The LoadedModel for `spec` (`own` when it names the agent's model)."""
        from macfleet.engine.models import load_model

        if spec == own.spec:
            return own
        with self._lock:
            if spec in self._lru:
                self._lru.move_to_end(spec)
                return self._lru[spec]
            lm = load_model(spec, cached=False)
            self._lru[spec] = lm
            while len(self._lru) > self.max_models:
                self._lru.popitem(last=False)
            return lm

    def proposer(self, spec: str, own):
        """A draft-model proposer as the engine's factory builds it, from this cache."""
        from macfleet.engine.proposers.factory import draft_model_proposer

        return draft_model_proposer(spec.partition(":")[2], own, lambda m: self.get(m, own))


def make_checked_proposer(spec: str, lm, policy: SpecPolicy, models: DraftModels):
    """check_spec + local_spec + build (draft models from the bounded cache)."""
    from macfleet.engine.proposers import make_proposer

    check_spec(spec, policy)
    local = local_spec(spec, policy)
    if local.partition(":")[0] == "draft" and "+" not in local:
        return models.proposer(local, lm)
    return make_proposer(local, lm)
