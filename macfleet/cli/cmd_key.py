"""`macfleet key export | import`: move the fleet key between Macs as one copyable line.

`export` prints only the line on stdout (so `macfleet key export | ssh mac2 macfleet key import -`
works) and the fleet id on stderr; `import` checks the line's checksum, then writes the key file
with mode 0600 and prints the fleet id, which must match the one `export` printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from macfleet.cli.common import UserError


def add_parser(sub) -> None:
    k = sub.add_parser("key", help="export the fleet key as one line / import it on another Mac")
    ksub = k.add_subparsers(dest="key_command", required=True, metavar="export|import")
    e = ksub.add_parser("export", help="print the fleet key as one copyable line")
    e.add_argument("--key", default=None, metavar="FILE",
                   help="key file (default: ~/.macfleet/fleet.key)")
    e.set_defaults(func=run_export)
    i = ksub.add_parser("import", help="write the fleet key from a line of `key export`")
    i.add_argument("line", nargs="?", default="-", help="the line, or - (default) to read it "
                   "from stdin")
    i.add_argument("--key", default=None, metavar="FILE",
                   help="key file to write (default: ~/.macfleet/fleet.key)")
    i.add_argument("--force", action="store_true", help="replace another fleet key (this Mac "
                   "leaves its old fleet)")
    i.set_defaults(func=run_import)


def _path(args) -> Path:
    from macfleet.fleet.keys import default_key_path

    return Path(args.key).expanduser() if args.key else default_key_path()


def run_export(args) -> int:
    from macfleet.fleet.client import fleet_id
    from macfleet.fleet.keys import KeyPathMissing, export_line, load_key

    path = _path(args)
    if args.key and not path.exists():  # the same error as every command's --key FILE
        raise UserError(str(KeyPathMissing(path)))
    if not path.exists():
        raise UserError(f"no fleet key at {path}: run `macfleet keygen` on the first Mac, or "
                        "`macfleet key import` with the line of a Mac of your fleet")
    try:
        key = load_key(path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the fleet key: {e}") from None
    print(export_line(key), flush=True)
    print(f"fleet id {fleet_id(key)}; on each other Mac: macfleet key import 'LINE'",
          file=sys.stderr)
    return 0


def run_import(args) -> int:
    from macfleet.fleet.client import fleet_id
    from macfleet.fleet.keys import parse_line, write_key

    if args.line != "-":
        line = args.line
    elif sys.stdin.isatty():  # typed or pasted: one line, no Ctrl-D needed
        try:
            line = input("the line of `macfleet key export`: ")
        except EOFError:
            line = ""
    else:
        line = sys.stdin.read()
    try:
        key = parse_line(line)
    except ValueError as e:
        raise UserError(f"key not imported: {e}") from None
    path = _path(args)
    try:
        wrote = write_key(path, key, overwrite=args.force)
    except FileExistsError:
        raise UserError(f"{path} holds another fleet key; nothing was changed. Use --force to "
                        "replace it (this Mac then leaves its old fleet)") from None
    except OSError as e:
        raise UserError(f"cannot write {path}: {e}") from None
    what = "wrote" if wrote else "already had this key in"
    print(f"{what} {path} (fleet id {fleet_id(key)}); restart this Mac's agent to use it "
          "(`macfleet service install` replaces a running one)")
    return 0
