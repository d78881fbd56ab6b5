"""`eagle[:PATH]` / `eagle2[:PATH]`: the head (or the shipped one) loaded once per process; the
one place that knows both the chain and the tree drafter."""

from __future__ import annotations

from pathlib import Path

from macfleet.engine.proposers.eagle.chain import EagleProposer
from macfleet.engine.proposers.eagle.head import EagleHead, HeadMismatch, load_head, weights_path
from macfleet.engine.proposers.eagle.tree import EagleTreeProposer
from macfleet.engine.proposers.shipped import default_head_path

_heads: dict[tuple[str, int, int], EagleHead] = {}


def shared_head(path: Path, verifier) -> EagleHead:
    """The head at `path` for this verifier model, loaded once per process (and when rewritten)."""
    try:
        st = weights_path(path).stat()
    except OSError:
        return load_head(path, verifier)  # raises the clear error
    key = (str(weights_path(path).resolve()), st.st_mtime_ns, id(verifier))
    head = _heads.get(key)
    if head is None or head.verifier is not verifier:
        head = _heads[key] = load_head(path, verifier)
    return head


def make_eagle_proposer(arg: str, verifier, error: type[Exception] = ValueError,
                        tree: bool = False) -> EagleProposer:
    """`eagle[:PATH]` / `eagle2[:PATH]`: the head at PATH, or the one shipped for the verifier."""
    kind = "eagle2" if tree else "eagle"
    path = Path(arg).expanduser() if arg else default_head_path(verifier.spec)
    if path is None:
        raise error(f"{kind}: no head is shipped for {verifier.spec}; train one with "
                    f"`macfleet distill --model {verifier.spec} --out PATH` and use {kind}:PATH")
    try:
        head = shared_head(path, verifier.model)
    except HeadMismatch as e:
        raise error(f"{kind}: {e}") from e
    name = f"{kind}:{arg}" if arg else kind
    return EagleTreeProposer(head, name=name) if tree else EagleProposer(head, name=name)
