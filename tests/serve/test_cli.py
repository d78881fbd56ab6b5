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


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def test_up_serve_takes_every_option_serve_takes_for_a_fleet(tmp_path):
    """`up --serve` shares serve's builder (no copy): every option of serve but the
    in-process verifier's, and fleet_serve_args hands them all to serve (issue 43: without
    --chat-template there, tools through `up --serve` were always a 400)."""
    from macfleet.cli import cmd_serve

    cmds = _names(build_parser())
    serve, up = cmds["serve"], cmds["up"]
    in_process = {o for g in serve._action_groups if g.title and "in-process" in g.title
                  for a in g._group_actions for o in a.option_strings}
    assert "--chat-template" in _options(up) and "--api-key-file" in _options(up)
    assert _options(serve) - in_process - {"--local"} <= _options(up)  # --batch-sessions:
    # up's own, the verifier agent's batch and the server's at once
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    argv = ["--serve", "--model", "tiny:1", "--open", "--chat-template", str(template),
            "--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--proposer", "none",
            "--draft-tokens", "3", "--batch-sessions", "2", "--max-queue", "5",
            "--max-tokens-cap", "77", "--max-prompt-tokens", "99", "--max-body-bytes", "1000",
            "--max-sessions-per-client", "3", "--wait", "1.5"]
    a = cmd_serve.fleet_serve_args(up.parse_args(argv))
    assert (a.chat_template, a.host, a.port, a.api_key, a.proposer, a.draft_tokens) == (
        template, "0.0.0.0", 0, ["k"], "none", "3")
    assert (a.batch_sessions, a.max_queue, a.max_tokens_cap, a.max_prompt_tokens,
            a.max_body_bytes, a.max_sessions_per_client, a.wait) == (2, 5, 77, 99, 1000, 3, 1.5)
    assert (a.model, a.open, a.key, a.local) == ("tiny:1", True, None, False)
    assert up.parse_args(["--serve"]).wait == 5.0  # a fleet just started: a longer look
    with pytest.raises(SystemExit):  # one key or the other, as on serve
        up.parse_args(["--api-key", "k", "--api-key-file", str(template)])


@pytest.mark.parametrize("argv,msg", [
    (["--port", "70000"], "--port must be 0..65535"),
    (["--chat-template", "/nonexistent/t.jinja"], "cannot read --chat-template"),
    (["--batch-sessions", "-1"], "--batch-sessions must be >= 0"),
])
def test_up_serve_refuses_bad_serve_options_before_starting_agents(argv, msg, capsys,
                                                                     monkeypatch):
    from macfleet.fleet import local

    def started(*a, **k):
        raise AssertionError("agents started before the options were checked")

    monkeypatch.setattr(local, "up", started)
    assert main(["up", "--open", "--serve", *argv]) == 2
    assert msg in capsys.readouterr().err
