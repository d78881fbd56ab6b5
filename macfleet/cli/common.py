"""What every `macfleet` command shares: the user-error type, the fleet-key arguments and the
argument parsers that more than one command uses. Imports nothing of the commands (cli/main.py
imports them), so there is no import circle."""

from __future__ import annotations

from macfleet.engine import controller
from macfleet.engine.controller import DraftTokens


# The drafter of `generate`, `serve` and `demo` unless --proposer names one: in one process
# chosen block by block (engine/choosing.py), through agents the one measured best for the
# model (engine/proposers/choice.py).
DEFAULT_PROPOSER = "auto"


class UserError(Exception):
    """An error caused by the user's input, printed without a traceback (exit status 2)."""


def add_key_args(p, *, open_help: str = "no key: an unauthenticated fleet (trusted networks "
                 "only)") -> None:
    """--key and --open, the same on every command that talks to a fleet."""
    p.add_argument("--key", default=None, metavar="FILE",
                   help="fleet key file (default: ~/.macfleet/fleet.key; must exist when given)")
    p.add_argument("--open", action="store_true", help=open_help)


def fleet_key(args, *, create: bool = False) -> bytes | None:
    """The fleet key named by --key/--open (fleet/keys.py), or a UserError that says what to do."""
    from macfleet.fleet.keys import KeyMissing

    try:
        return fleet_key_if_any(args, create=create)
    except KeyMissing as e:
        raise UserError(str(e)) from None


def fleet_key_if_any(args, *, create: bool = False) -> bytes | None:
    """As fleet_key, but no key at the default path raises KeyMissing (a command that can run
    without a fleet goes on without one); a --key file that does not exist, or one that cannot
    be read, is a UserError everywhere."""
    from macfleet.fleet.keys import KeyMissing, KeyPathMissing, resolve_key

    try:
        return resolve_key(args.key, open_fleet=args.open, create=create)
    except (KeyMissing, KeyPathMissing) as e:
        if isinstance(e, KeyPathMissing):
            raise UserError(str(e)) from None
        raise
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
    except ValueError as e:  # SamplingParams names the API's fields: name the flags instead
        raise UserError(flag_names(str(e))) from None


FIELD_FLAGS = (("temperature", "--temp"), ("top_p", "--top-p"), ("seed", "--seed"))


def flag_names(message: str) -> str:
    """Pure: an engine message that names request fields ("top_p must be ...") as it reads
    for the CLI user ("--top-p must be ...")."""
    for field, flag in FIELD_FLAGS:
        if message.startswith(field + " "):
            return flag + message[len(field):]
    return message


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
