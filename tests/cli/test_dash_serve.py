"""`macfleet dash --serve URL`: which sources the dashboard gets (no terminal, no network)."""

from __future__ import annotations

import pytest

import tui.app
from macfleet.cli.common import UserError
from macfleet.cli.main import build_parser
from macfleet.fleet import observer
from macfleet.fleet.keys import keygen
from macfleet.fleet.serve_watch import ServeWatchSource
from macfleet.fleet.snapshot import StaticSource


@pytest.fixture
def dashboards(monkeypatch, tmp_path):
    """Sources handed to the dashboard; a fake fleet observer; an empty MACFLEET_HOME."""
    monkeypatch.setenv("MACFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MACFLEET_API_KEY", raising=False)
    got = []
    monkeypatch.setattr(tui.app, "run_dashboard", lambda src, refresh_s: got.append(src))
    monkeypatch.setattr(observer, "FleetObserver", lambda key, loopback: StaticSource())
    return got


def _run(*argv: str) -> int:
    args = build_parser().parse_args(["dash", *argv])
    return args.func(args)


def test_serve_alone_without_a_fleet_key(dashboards):
    assert _run("--serve", "http://127.0.0.1:8000/v1", "--api-key", "k") == 0
    (src,) = dashboards
    assert isinstance(src, ServeWatchSource) and src.inner is None and src.api_key == "k"


def test_serve_over_the_fleet_when_there_is_a_key(dashboards, tmp_path, monkeypatch):
    keygen(tmp_path / "home" / "fleet.key")
    monkeypatch.setenv("MACFLEET_API_KEY", "from-env")
    assert _run("--serve", "127.0.0.1:8000") == 0
    (src,) = dashboards
    assert isinstance(src.inner, StaticSource) and src.api_key == "from-env"


@pytest.mark.parametrize("argv", [["--serve", "ftp://h"], ["--serve", "h:1", "--replay", "x"]])
def test_bad_serve_arguments_are_user_errors(dashboards, argv):
    with pytest.raises(UserError):
        _run(*argv)
    assert not dashboards
