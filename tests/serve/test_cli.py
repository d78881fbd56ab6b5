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
