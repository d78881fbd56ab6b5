"""Every command's help, as a user reads it: each option has help text and shows its default,
and one idea has one flag name in every command that takes it (parse-only: no model, no
fleet)."""

from __future__ import annotations

import argparse

import pytest

from macfleet.cli.main import build_parser


def _walk(p: argparse.ArgumentParser, name: str = ""):
    yield name, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub_name, sub in a.choices.items():
                yield from _walk(sub, f"{name} {sub_name}".strip())


PARSERS = dict(_walk(build_parser()))


def _flags(cmd: str) -> set[str]:
    return set(PARSERS[cmd]._option_string_actions)


def test_every_command_is_walked():
    for want in ("generate", "agent", "up", "ls", "keygen", "serve", "plan", "dash", "demo",
                 "distill", "export", "doctor", "service install", "key export", "bench",
                 "bench fleet", "bench soak", "bench sessions", "bench overhead", "bench drafter",
                 "bench serve", "bench heads", "bench tree-shapes", "bench moe", "bench f3"):
        assert want in PARSERS, want
    assert sum(name.startswith("bench ") for name in PARSERS) >= 19


@pytest.mark.parametrize("cmd", sorted(PARSERS))
def test_every_option_has_help_and_shows_its_default(cmd):
    """An option that takes a value says what it is and what it is when not given: argparse's
    "(default: X)" (cli/parser.py adds it), or the help's own words where X alone says little
    (a path looked up at run time, "random")."""
    parser = PARSERS[cmd]
    fmt = parser._get_formatter()
    missing = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(a.option_strings) or a.dest
        text = fmt._expand_help(a) if a.help else ""
        if not text.strip():
            missing.append(f"{name}: no help")
        elif a.option_strings and a.nargs != 0 and not a.required and "default" not in text:
            missing.append(f"{name}: no default shown")
    assert not missing, f"macfleet {cmd}: {missing}"
    assert parser.format_help()


# concept -> (the one flag, the commands that take it). A command that takes the concept under
# another name fails the first test; an old name left anywhere fails the second.
VOCABULARY = {
    "drafter spec": ("--proposer", {
        "generate", "serve", "demo", "plan", "bench fleet", "bench soak", "bench sessions",
        "bench overhead", "bench drafter", "bench serve"}),
    "sessions verified in one batch": ("--batch-sessions", {"agent", "up", "serve"}),
    "answer length": ("--max-tokens", {
        "generate", "demo", "distill", "bench local", "bench fleet", "bench soak",
        "bench sessions", "bench topologies", "bench drafter", "bench heads",
        "bench tree-shapes", "bench serve", "bench batch-identity", "bench moe",
        "bench overhead", "bench pair", "bench pair-dial"}),
    "repeats": ("--repeats", {
        "demo", "bench verify-sweep", "bench local", "bench fastmath", "bench fleet", "bench f3",
        "bench security", "bench drafter", "bench tree-shapes", "bench moe", "bench overhead",
        "bench serve", "bench pair-dial"}),
    "tokens drafted per block": ("--draft-tokens", {"generate", "serve", "bench pair"}),
    "fleet key file": ("--key", {"generate", "serve", "agent", "up", "ls", "keygen", "plan",
                                 "dash", "bench", "key export", "key import"}),
    "seconds to look for agents": ("--wait", {"generate", "serve", "ls", "plan", "bench"}),
    "model spec": ("--model", {"generate", "serve", "agent", "up", "demo", "plan", "distill",
                               "export", "bench", "bench overhead"}),
}
# names the ideas above had before: none may come back (no aliases)
RETIRED = ("--spec", "--specs", "--drafters", "--proposers", "--max-active", "--max-answer",
           "--rounds", "--big-tokens", "--gen-tokens", "--reps", "--k")


@pytest.mark.parametrize("concept", sorted(VOCABULARY))
def test_one_idea_has_one_flag_in_every_command(concept):
    flag, commands = VOCABULARY[concept]
    lacking = sorted(c for c in commands if flag not in _flags(c))
    assert not lacking, f"{concept}: {flag} missing in {lacking}"


def test_no_command_keeps_a_retired_name():
    kept = sorted(f"{cmd} {f}" for cmd in PARSERS for f in RETIRED if f in _flags(cmd))
    assert not kept, kept


def test_a_drafter_spec_is_never_called_draft():
    # `--draft` may name a draft MODEL (`up --draft`), a different idea; the commands that take a
    # drafter spec name it --proposer only
    drafter_cmds = VOCABULARY["drafter spec"][1]
    assert not [c for c in drafter_cmds if "--draft" in _flags(c)]


def test_loopback_means_one_thing():
    # agent: advertise on 127.0.0.1; the dashboard's "look on 127.0.0.1" has its own name
    assert [c for c in PARSERS if "--loopback" in _flags(c)] == ["agent"]
    assert "--watch-loopback" in _flags("dash")


def test_generate_and_serve_default_to_the_same_drafter_and_say_which():
    from macfleet.cli.common import DEFAULT_PROPOSER

    for cmd in ("generate", "serve", "demo"):
        a = PARSERS[cmd]._option_string_actions["--proposer"]
        assert a.default == DEFAULT_PROPOSER == "auto", cmd
        assert "(default: auto)" in PARSERS[cmd]._get_formatter()._expand_help(a), cmd


def test_service_install_help_shows_the_agent_options_it_passes_on():
    text = PARSERS["service install"].format_help()
    for flag in ("--model", "--proposer-kinds", "--batch-sessions", "--loopback", "--key"):
        assert flag in text, flag
