"""What ships in proposers/weights/ for the embedded verifier (pyproject's package-data): the
EAGLE head with its held-out `.eval.json` (which `auto` reads) and the answer store."""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).parent / "weights"
SHIPPED_HEADS = {"smollm2": "smollm2-eagle"}
SHIPPED_STORES = {"smollm2": "smollm2-answers.npy"}


def default_head_path(verifier_spec: str) -> Path | None:
    """The head shipped for this verifier (`smollm2`, `smollm2:...`), None when none is."""
    name = SHIPPED_HEADS.get(verifier_spec.partition(":")[0])
    return WEIGHTS_DIR / f"{name}.safetensors" if name else None


def default_store_path(verifier_spec: str) -> Path | None:
    """The answer store shipped for this verifier, None when none is."""
    name = SHIPPED_STORES.get(verifier_spec.partition(":")[0])
    return WEIGHTS_DIR / name if name else None
