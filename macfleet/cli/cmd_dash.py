"""`macfleet dash`: the Textual dashboard, live (Zeroconf + metrics) or from a recording."""

from __future__ import annotations

from macfleet.cli.common import UserError, add_key_args, fleet_key


def add_parser(sub) -> None:
    p = sub.add_parser("dash", help="the live fleet dashboard")
    p.add_argument("--replay", default=None, metavar="FILE",
                   help="play a recorded JSON-lines file instead (default: the live fleet)")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="also record the snapshots to this file (default: not recorded)")
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between screen updates")
    p.add_argument("--watch-loopback", action="store_true",
                   help="look for agents on 127.0.0.1 only (agents started with `agent "
                   "--loopback`, or by `macfleet up`)")
    p.add_argument("--serve", default=None, metavar="URL",
                   help="also show the batch of this `macfleet serve` (e.g. "
                   "http://127.0.0.1:8000; default: none); without a fleet key, only it")
    p.add_argument("--api-key", default=None,
                   help="the server's API key (default: $MACFLEET_API_KEY)")
    add_key_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from macfleet.fleet.snapshot import RecordingSource, ReplaySource, SnapshotFormatError
    from tui.app import run_dashboard

    if args.replay and args.serve:
        raise UserError("--serve watches a live server; --replay plays a recording (which "
                        "holds the batch it was recorded with)")
    if args.replay:
        try:
            source = ReplaySource(args.replay)
        except (OSError, SnapshotFormatError) as e:
            raise UserError(f"cannot replay {args.replay}: {e}") from None
    else:
        source = _fleet_source(args)
    if args.serve:
        source = _serve_source(args, source)
    if args.record:
        source = RecordingSource(source, args.record)
    try:
        run_dashboard(source, refresh_s=args.refresh)
    finally:
        source.close()
    return 0


def _fleet_source(args):
    """The fleet observer; with --serve and no fleet key, None (the server alone is shown)."""
    from macfleet.cli.common import fleet_key_if_any
    from macfleet.fleet.keys import KeyMissing
    from macfleet.fleet.observer import FleetObserver

    if args.serve and not args.open:
        try:
            fleet_key_if_any(args)
        except KeyMissing:
            return None
    return FleetObserver(fleet_key(args), loopback=args.watch_loopback)


def _serve_source(args, inner):
    import os

    from macfleet.fleet.serve_watch import ServeWatchSource

    try:
        return ServeWatchSource(args.serve, inner,
                                api_key=args.api_key or os.environ.get("MACFLEET_API_KEY"))
    except ValueError as e:
        if inner is not None:
            inner.close()
        raise UserError(f"--serve: {e}") from None
