"""`macfleet` command line: subcommands map to functions; no logic of its own."""

from __future__ import annotations

import logging
import sys

from macfleet.cli.common import UserError
from macfleet.cli.parser import Parser, unknown_arguments_message
from macfleet.cli.preload import ensure_openblas

DESCRIPTION = """\
Run a language model on this Mac, or across the Macs on your desk: one Mac verifies, the others
draft tokens ahead of it (speculative decoding), and the answer is the one the verifying model
alone would give.

  macfleet generate "Why is the sky blue?"       an answer (through the fleet when there is one)
  macfleet up                                    a fleet on this machine (verifier + proposer)
  macfleet agent --role verifier|proposer        the agent of one Mac (`service install` keeps it)
  macfleet ls                                    the agents this Mac can see
  macfleet serve                                 an OpenAI-compatible API

`macfleet COMMAND --help` shows a command's options and their defaults."""


def build_parser() -> Parser:
    from macfleet.cli import cmd_bench, cmd_dash, cmd_demo, cmd_doctor, cmd_fleet, cmd_generate
    from macfleet.cli import cmd_plan
    from macfleet.cli import cmd_distill
    from macfleet.cli import cmd_export, cmd_key, cmd_serve, cmd_service

    p = Parser(prog="macfleet", description=DESCRIPTION)
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log more (-v: info, -vv: debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (cmd_generate, cmd_fleet, cmd_demo, cmd_dash, cmd_doctor, cmd_bench,
                cmd_plan, cmd_distill, cmd_serve, cmd_export, cmd_key, cmd_service):
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        ensure_openblas()
    parser = build_parser()
    # `service install --role R [agent options]` passes the options of `agent` on (checked by
    # the agent's own parser there); every other command refuses what it does not know, naming
    # the nearest options it has
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_agent_args", False):
        print(unknown_arguments_message(args, extra), file=sys.stderr)
        return 2
    args.agent_args = extra
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except UserError as e:
        print(f"macfleet: error: {e}", file=sys.stderr)
        return 2
