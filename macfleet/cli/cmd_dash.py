"""`macfleet dash`: the Textual dashboard, live (Zeroconf + metrics) or from a recording."""

from __future__ import annotations

from macfleet.cli.common import UserError, add_key_args, fleet_key


def add_parser(sub) -> None:
    p = sub.add_parser("dash", help="the live fleet dashboard")
    p.add_argument("--replay", default=None, help="play a recorded JSON-lines file instead")
    p.add_argument("--record", default=None, help="also record the snapshots to this file")
    p.add_argument("--refresh", type=float, default=1.0)
    p.add_argument("--loopback", action="store_true", help="browse 127.0.0.1 only")
    add_key_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from macfleet.fleet.snapshot import RecordingSource, ReplaySource, SnapshotFormatError
    from tui.app import run_dashboard

    if args.replay:
        try:
            source = ReplaySource(args.replay)
        except (OSError, SnapshotFormatError) as e:
            raise UserError(f"cannot replay {args.replay}: {e}") from None
    else:
        from macfleet.fleet.observer import FleetObserver

        source = FleetObserver(fleet_key(args), loopback=args.loopback)
    if args.record:
        source = RecordingSource(source, args.record)
    try:
        run_dashboard(source, refresh_s=args.refresh)
    finally:
        source.close()
    return 0
