"""The serving commands are registered, render their help, and refuse bad options before
loading any model."""

from __future__ import annotations

import argparse

import pytest

from macfleet.cli.main import build_parser, main


def _names(p: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out[prefix + name] = sub
                out.update(_names(sub, prefix + name + " "))
    return out


def test_serving_commands_render_help():
    cmds = _names(build_parser())
    for want in ("serve", "export", "bench serve", "bench serve-soak", "bench batch-identity"):
        assert cmds[want].format_help(), want
    assert "--batch-invariant" in cmds["serve"].format_help()
    up = cmds["up"].parse_args(["--serve"])
    assert up.serve


@pytest.mark.parametrize("argv,msg", [
    (["serve", "--token-budget", "0"], "--token-budget must be >= 1"),
    (["serve", "--port", "70000"], "--port must be 0..65535"),
    (["serve", "--draft-tokens", "x"], "--draft-tokens"),
    (["serve", "--stall-ratio", "-1"], "--stall-ratio"),
])
def test_bad_serve_options_are_user_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.slow  # starts a server process
def test_serve_says_why_it_serves_in_process(tmp_path, monkeypatch):
    """No fleet key here: one line says so, and that it serves in-process; with a key and no
    agent, that none answered within --wait."""
    from serve_testkit import start_server, stop_server

    monkeypatch.setenv("MACFLEET_HOME", str(tmp_path / "mf"))
    monkeypatch.delenv("MACFLEET_KEY", raising=False)
    s = start_server("--wait", "0.2", local=False)
    stop_server(s)
    assert [ln for ln in s.before if ln.startswith("macfleet serve: no fleet key at ")
            and ln.endswith("serving in-process")], s.before
    assert "in-process" in s.banner
    from macfleet.fleet.keys import keygen

    keygen(tmp_path / "mf" / "fleet.key")
    s = start_server("--wait", "0.2", local=False)
    stop_server(s)
    assert [ln for ln in s.before if ln.startswith("macfleet serve: no agents in fleet ") and
            ln.endswith("after 0.2 s: serving in-process; `--local` skips the wait")], s.before
