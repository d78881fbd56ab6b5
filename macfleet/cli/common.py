"""What every `macfleet` command shares: the user-error type, the fleet-key arguments and the
argument parsers that more than one command uses. Imports nothing of the commands (cli/main.py
imports them), so there is no import circle."""

from __future__ import annotations

from macfleet.engine import controller
from macfleet.engine.controller import DraftTokens


class UserError(Exception):
    """An error caused by the user's input, printed without a traceback (exit status 2)."""


def add_key_args(p, *, open_help: str = "no key: an unauthenticated fleet (trusted networks "
                 "only)") -> None:
    """--key and --open, the same on every command that talks to a fleet."""
    p.add_argument("--key", default=None, help="fleet key file (default ~/.macfleet/fleet.key)")
    p.add_argument("--open", action="store_true", help=open_help)


def fleet_key(args, *, create: bool = False) -> bytes | None:
    """The fleet key named by --key/--open (fleet/keys.py), or a UserError that says what to do."""
    from macfleet.fleet.keys import KeyMissing, resolve_key

    try:
        return resolve_key(args.key, open_fleet=args.open, create=create)
    except KeyMissing as e:
        raise UserError(str(e)) from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the fleet key: {e}") from None


def parse_draft_tokens(v: str) -> DraftTokens:
    """--draft-tokens: AUTO or 0..MAX_DRAFT_TOKENS (engine/controller.py)."""
    try:
        return controller.parse_draft_tokens(v)
    except ValueError as e:
        raise UserError(f"--draft-tokens {e}") from None


def sampling_params(args):
    """--temp, --top-p, --seed -> SamplingParams (UserError when out of range)."""
    from macfleet.engine.sampling import SamplingParams

    try:
        return SamplingParams(args.temp, args.top_p, args.seed)
    except ValueError as e:
        raise UserError(str(e)) from None


def load_model(spec: str, **kw):
    """engine.models.load_model behind a spinner (a terminal) or a start and a done line (a
    file, CI): loading a model takes seconds to minutes."""
    from macfleet import progress
    from macfleet.engine import models

    ensure_model(spec)
    with progress.waiting(f"loading {spec}"):
        return models.load_model(spec, **kw)


def ensure_model(spec: str) -> None:
    """The embedded model fetched on first use when a command needs it and it is missing
    (macfleet/fetch.py); UserError (one line: what to do) when that fails."""
    from macfleet.fetch import FetchError, ensure_embedded_model

    try:
        ensure_embedded_model(spec)
    except FetchError as e:
        raise UserError(str(e)) from None


def bench_runs(name: str, total: int | None = None):
    """The `progress(msg)` a benchmark takes, as a bar of its runs (runs left when `total` is
    known) on a terminal, its messages as plain lines elsewhere (macfleet/progress.py)."""
    from macfleet import progress

    return progress.runs(f"bench {name}", total)
