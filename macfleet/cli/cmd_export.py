"""`macfleet export`: the embedded (or any loaded llama-family) model as an mlx-lm directory."""

from __future__ import annotations

from pathlib import Path

from macfleet.cli.common import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a model as an mlx-lm directory (for mlx_lm tools)")
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--model", default="smollm2:dense", help="the model spec to write")
    p.set_defaults(func=run)


def run(args) -> int:
    from macfleet import progress
    from macfleet.cli.common import load_model
    from macfleet.engine.export import ExportError, export_mlx_lm
    from macfleet.engine.models import ModelSpecError

    try:
        lm = load_model(args.model)
        with progress.waiting(f"writing {args.out} (weights and tokenizer)"):
            path = export_mlx_lm(lm, args.out)
    except (ModelSpecError, ExportError, OSError) as e:
        raise UserError(str(e)) from None
    print(f"wrote {path} (load it with mlx_lm.load('{path}'))")
    return 0
