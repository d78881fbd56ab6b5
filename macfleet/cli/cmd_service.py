"""`macfleet service install|uninstall|status|logs`: keep this Mac's agent running for good
(launchd on macOS, systemd --user on Linux); the definitions are macfleet/fleet/service.py's.

`install --role R [agent options]` takes the options of `macfleet agent` after the role, checks
them (and the fleet key) before writing anything, so a service never crash-loops on a typo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from macfleet.cli.common import UserError

DEFAULT_LOG_LINES = 50
DEFAULT_CARD_WAIT_S = 2.0


def add_parser(sub) -> None:
    from macfleet.fleet.service import ROLES

    s = sub.add_parser("service", help="run this machine's agent as a launchd / systemd user "
                       "service: started at login, restarted if it dies")
    ssub = s.add_subparsers(dest="service_command", required=True,
                            metavar="install|uninstall|status|logs")
    i = ssub.add_parser("install", allow_abbrev=False,
                        help="install (or replace) and start the agent service; any option of "
                        "`macfleet agent` may follow the role",
                        description="Install (or replace) and start this Mac's agent as a "
                        "service: one verifier Mac, proposers on the others, the same fleet key "
                        "on all (`macfleet key export | ssh mac2 macfleet key import`).",
                        epilog=agent_options_help())
    i.add_argument("--role", required=True, choices=ROLES,
                   help="the agent's role (`macfleet agent --role`)")
    i.set_defaults(func=run_install, accepts_agent_args=True)
    u = ssub.add_parser("uninstall", help="stop the agent service and remove it")
    u.add_argument("--role", choices=ROLES, default=None, help="default: every installed one")
    u.set_defaults(func=run_uninstall)
    st = ssub.add_parser("status", help="whether the agent service runs, and its Zeroconf card")
    st.add_argument("--role", choices=ROLES, default=None, help="default: every installed one")
    st.add_argument("--wait", type=float, default=DEFAULT_CARD_WAIT_S,
                    help="seconds to look for its Zeroconf card (0: do not look)")
    st.set_defaults(func=run_status)
    lg = ssub.add_parser("logs", help="the agent service's log (journald or ~/Library/Logs)")
    lg.add_argument("--role", choices=ROLES, default=None, help="default: the one installed")
    lg.add_argument("-n", "--lines", type=int, default=DEFAULT_LOG_LINES,
                    help="the last N lines of the log")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    lg.set_defaults(func=run_logs)


def agent_options_help() -> str:
    """The options of `macfleet agent` that `service install` passes on, as its help shows them
    (the agent's own parser formats them: one definition)."""
    from macfleet.cli import cmd_fleet
    from macfleet.cli.parser import Parser, unknown_arguments_message

    parser = Parser(prog="macfleet")
    cmd_fleet.add_parser(parser.add_subparsers(dest="command"))
    agent = parser._subparsers._group_actions[0].choices["agent"]
    text = agent.format_help()
    lines = text[text.index("options:"):].splitlines()[2:]  # past "options:" and -h
    start = next(i for i, ln in enumerate(lines) if ln.startswith("  --")
                 and not ln.startswith("  --role"))  # the role is install's own option
    return "options of `macfleet agent` it passes on (after --role):\n" + "\n".join(lines[start:])


def _manager():
    from macfleet.fleet.service_shell import ServiceManagerMissing, manager_for

    try:
        return manager_for()
    except ServiceManagerMissing as e:
        raise UserError(f"no service manager to keep an agent running: {e}") from None


def _checked(fn, *a):
    from macfleet.fleet.service_shell import ServiceError, ServiceManagerMissing

    try:
        return fn(*a)
    except ServiceManagerMissing as e:
        raise UserError(f"no service manager to keep an agent running: {e}. Without one, run "
                        "`macfleet agent --role ROLE ...` under a supervisor of your own") from None
    except ServiceError as e:
        raise UserError(str(e)) from None


def check_agent_args(role: str, agent_args: list[str]):
    """The agent's own parser on the options (a typo is refused now, not in a crash loop), and
    the fleet key they name (missing or unsafe: refused now, with the fix)."""
    from macfleet.cli import cmd_fleet  # where `macfleet agent` and its options are defined
    from macfleet.cli.common import fleet_key
    from macfleet.cli.parser import Parser, unknown_arguments_message

    if "--role" in agent_args or any(a.startswith("--role=") for a in agent_args):
        raise UserError("give the role once, as `service install --role R`")
    parser = Parser(prog="macfleet")
    cmd_fleet.add_parser(parser.add_subparsers(dest="command", required=True))
    try:
        ns, extra = parser.parse_known_args(["agent", "--role", role, *agent_args])
    except SystemExit:  # argparse has printed what is wrong with a value (and the usage)
        raise UserError(f"not options of `macfleet agent`: {' '.join(agent_args)} "
                        "(see `macfleet agent --help`)") from None
    if extra:
        line = unknown_arguments_message(ns, extra)
        raise UserError(line.split(": error: ", 1)[-1])
    if role == "shard" and (not ns.group or ns.group_size < 2):
        raise UserError("a shard agent needs --group NAME and --group-size N >= 2")
    fleet_key(ns)  # UserError when missing or unsafe
    return ns


def run_install(args) -> int:
    from macfleet.fleet import service as svc
    from macfleet.fleet import service_shell as sh

    agent_args = list(getattr(args, "agent_args", []))
    ns = check_agent_args(args.role, agent_args)
    if ns.key:  # the service does not start in this directory: an absolute key path
        i = agent_args.index("--key") if "--key" in agent_args else None
        absolute = str(Path(ns.key).expanduser().absolute())
        if i is not None:
            agent_args[i + 1] = absolute
        else:
            agent_args = [a if not a.startswith("--key=") else f"--key={absolute}"
                          for a in agent_args]
    spec = svc.ServiceSpec(args.role, svc.agent_argv(sys.executable, args.role,
                                                     tuple(agent_args)),
                           svc.service_env(dict(os.environ)), str(Path.home()))
    m = _manager()
    replacing = m.path(spec).exists()
    path = _checked(sh.install, m, spec)
    print(f"{'replaced' if replacing else 'installed'} {path} ({m.name}); the {args.role} agent "
          f"{svc.agent_name(args.role, tuple(agent_args))} starts at login and again if it dies")
    if isinstance(m, sh.SystemdUser):
        print("  without a login session it stops at logout: `loginctl enable-linger $USER` "
              "keeps it running")
    print("  `macfleet service status` shows it; `macfleet service logs -f` follows its log")
    return 0


def _roles(m, role: str | None) -> list[str]:
    from macfleet.fleet import service_shell as sh

    if role:
        return [role]
    roles = _checked(lambda: (m.check(), sh.installed_roles(m))[1])
    if not roles:
        raise UserError("no macfleet service is installed here (`macfleet service install "
                        "--role R`)")
    return roles


def run_uninstall(args) -> int:
    from macfleet.fleet import service_shell as sh

    m = _manager()
    for role in _roles(m, args.role):
        existed = _checked(sh.uninstall, m, role)
        print(f"{'removed' if existed else 'no'} {role} agent service ({m.name})")
    return 0


def _card_line(states, wait_s: float) -> dict[str, str]:
    """role -> its agent's Zeroconf card, for the running ones (one browse for all)."""
    from macfleet.fleet import service as svc
    from macfleet.fleet.client import discover

    running = [s for s in states if s.running]
    if not running or wait_s <= 0:
        return {}
    names = {svc.agent_name(s.role, s.argv): s.role for s in running}
    try:
        cards = discover(None, wait_s=wait_s)
    except OSError as e:
        return {r: f"(cannot browse Zeroconf: {e})" for r in names.values()}
    out = {r: f"no Zeroconf card named {n} seen in {wait_s:g}s" for n, r in names.items()}
    for c in cards:
        if c.name in names:
            out[names[c.name]] = (f"card {c.name}: {'/'.join(c.roles)} {','.join(c.models)} at "
                                  f"{c.router_endpoint}, fleet {c.fleet_id}")
    return out


def run_status(args) -> int:
    from macfleet.fleet import service_shell as sh

    m = _manager()
    states = [_checked(sh.state, m, r) for r in _roles(m, args.role)]
    cards = _card_line(states, args.wait)
    for s in states:
        pid = f" pid {s.pid}" if s.pid else ""
        print(f"{s.role:9s} {'running' if s.running else 'NOT running'}{pid} ({m.name}: "
              f"{s.detail}) {s.path if s.installed else ''}".rstrip())
        if s.role in cards:
            print(f"          {cards[s.role]}")
    return 0 if all(s.running for s in states) else 3  # 3: LSB "not running"


def run_logs(args) -> int:
    from macfleet.fleet.service import ServiceSpec

    m = _manager()
    roles = _roles(m, args.role)
    if len(roles) > 1:
        raise UserError(f"services of several roles are installed ({', '.join(roles)}): "
                        "pick one with --role")
    cmd = m.logs_command(roles[0], m.path(ServiceSpec(roles[0], ())), args.lines, args.follow)
    try:
        return subprocess.run(cmd).returncode
    except FileNotFoundError:
        raise UserError(f"cannot show the log: {cmd[0]} is not installed") from None
