"""Every command and benchmark renders its help (argparse formats help strings lazily: a stray
'%' only fails when a user asks for --help)."""

from __future__ import annotations

import argparse

import pytest

from macfleet.cli.main import build_parser


def _subparsers(p: argparse.ArgumentParser):
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            yield from a.choices.items()


def test_every_command_and_bench_renders_help():
    root = build_parser()
    assert root.format_help()
    seen = []
    for name, sub in _subparsers(root):
        assert sub.format_help(), name
        seen.append(name)
        for bname, bsub in _subparsers(sub):
            assert bsub.format_help(), f"{name} {bname}"
            seen.append(f"{name} {bname}")
    for want in ("generate", "agent", "up", "down", "ls", "keygen", "demo", "dash", "plan",
                 "distill", "doctor", "bench", "bench verify-sweep", "bench local", "bench fleet",
                 "bench soak", "bench f3", "bench sessions", "bench topologies", "bench drafter",
                 "bench heads", "bench tree-shapes", "bench overhead", "key export",
                 "key import", "service install", "service uninstall", "service status",
                 "service logs"):
        assert want in seen, f"missing command: {want}"


def test_the_default_drafter_is_the_measured_best_and_a_weak_head_is_not_used():
    from macfleet.engine.proposers.choice import (MIN_HEAD_MEAN_ACCEPTED, choose_proposer,
                                                  resolve_proposer)

    assert choose_proposer(None)[0] == "ngram"
    good = {"held_out": {"mean_accepted": MIN_HEAD_MEAN_ACCEPTED + 0.1}}
    bad = {"held_out": {"mean_accepted": MIN_HEAD_MEAN_ACCEPTED - 0.1}}
    assert choose_proposer(good)[0] == "eagle2+ngram"
    spec, why = choose_proposer(bad)
    assert spec == "ngram" and "only" in why
    # a bench record wins over the held-out rule, whatever it says
    benched = dict(bad, bench={"best": "eagle2", "speedup": 1.4})
    spec, why = choose_proposer(benched)
    assert spec == "eagle2" and "1.40x" in why
    # in one process and across agents the measured best differ (a remote drafter's time is
    # off the critical path): each has its own record
    both = dict(bad, bench={"best": "ngram", "speedup": 1.01, "best_agents": "eagle2",
                            "speedup_agents": 1.12})
    assert choose_proposer(both)[0] == "ngram"
    spec, why = choose_proposer(both, "fleet")
    assert spec == "eagle2" and "across agents" in why and "1.12x" in why
    assert choose_proposer(benched, "fleet")[0] == "eagle2"  # no agents record: the one best
    assert resolve_proposer("ngram", "smollm2") == ("ngram", "asked for")
    assert resolve_proposer("auto", "tiny:1")[0] == "ngram"  # no head shipped for it


def test_this_machines_own_drafter_record_wins_over_the_shipped_one(tmp_path, monkeypatch):
    from macfleet.engine.cachedir import machine_id
    from macfleet.engine.proposers.choice import (choose_proposer, machine_record,
                                                  machine_record_path, record_machine_choice,
                                                  resolve_proposer)

    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path))
    shipped = {"bench": {"best": "eagle", "speedup": 1.5, "machine": "Linux-x86_64--2"}}
    spec, why = choose_proposer(shipped, here="Darwin-arm64-arm-12")
    assert spec == "eagle" and "Linux-x86_64--2" in why and "--record" in why
    spec, why = choose_proposer(shipped, here="Linux-x86_64--2")  # the reference machine
    assert "this machine" in why and "--record" not in why
    assert machine_record("smollm2") is None
    record_machine_choice("smollm2", {"best": "eagle2+retrieval+ngram", "speedup": 2.1,
                                      "best_agents": "eagle2", "speedup_agents": 1.8})
    mine = machine_record("smollm2")
    assert mine["machine"] == machine_id()
    spec, why = choose_proposer(shipped, mine=mine)
    assert spec == "eagle2+retrieval+ngram" and "this machine" in why and "2.10x" in why
    assert resolve_proposer("auto", "smollm2") == (spec, why)
    assert resolve_proposer("auto", "smollm2", "fleet")[0] == "eagle2"
    # a record another machine wrote into a shared cache directory is not this machine's
    path = machine_record_path("smollm2")
    path.write_text(path.read_text().replace(machine_id(), "Darwin-arm64-arm-12"))
    assert machine_record("smollm2") is None
    # a model with no shipped head still gets the drafter measured for it here
    record_machine_choice("tiny:1", {"best": "retrieval+ngram", "speedup": 1.2})
    assert resolve_proposer("auto", "tiny:1")[0] == "retrieval+ngram"


def _macfleet_commands(line: str):
    """The `macfleet` commands of a shell line: joined by && or |, or run over `ssh HOST '...'`."""
    import shlex

    words = shlex.split(line.split(" # ", 1)[0].split("  #", 1)[0])
    seg: list[str] = []
    for w in [*words, "&&"]:
        if w not in ("&&", "|"):
            seg.append(w)
            continue
        if seg[:1] == ["ssh"]:
            yield from _macfleet_commands(" ".join(shlex.quote(x) for x in seg[2:])
                                          if len(seg) > 3 else seg[2])
        elif seg[:1] == ["macfleet"]:
            yield seg[1:]
        seg = []


@pytest.mark.parametrize("heading,count", [("## Quickstart", 9), ("## Install on each Mac", 3)])
def test_the_readme_first_commands_parse(heading, count):
    """Each `macfleet` command of the README's first blocks (the quickstart, the two-Mac fleet,
    the install on each Mac) is one the CLI takes (a renamed option would leave the README's
    first steps broken)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```sh\n")[1:]]
    parser = build_parser()
    seen = []
    for line in "".join(blocks).splitlines():
        for words in _macfleet_commands(line):
            args, extra = parser.parse_known_args(words)
            assert not extra or getattr(args, "accepts_agent_args", False), line
            seen.append(words[0])
    assert len(seen) == count, seen
