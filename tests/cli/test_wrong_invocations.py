"""What a new user types wrong, and what they are told: one line that names the flag or the
model they typed and what to do (the real entry point, `macfleet.cli.main:main`; nothing
loads a model but the tiny one, and no agent runs)."""

from __future__ import annotations

import json

import pytest

from macfleet.cli.main import main


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh MACFLEET_HOME: no fleet key, no agents."""
    monkeypatch.setenv("MACFLEET_HOME", str(tmp_path / "mf"))
    monkeypatch.delenv("MACFLEET_KEY", raising=False)
    return tmp_path / "mf"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_a_mistyped_flag_gets_the_one_meant_and_its_value_is_not_the_prompt(capsys, home):
    rc, out, err = run(capsys, "generate", "--temperature", "0.7", "hi")
    line = one_line(err)
    assert rc == 2 and out == ""
    assert "--temperature is not an option of `macfleet generate`" in line
    assert "did you mean --temp?" in line and "0.7" not in line and " hi" not in line


@pytest.mark.parametrize("argv,typed,meant", [
    (("serve", "--max-qeue", "4"), "--max-qeue", "--max-queue"),
    (("bench", "fleet", "--max-tokns=5"), "--max-tokns", "--max-tokens"),
    (("ls", "--jsn"), "--jsn", "--json"),
])
def test_every_command_suggests_its_own_options(capsys, home, argv, typed, meant):
    rc, _, err = run(capsys, *argv)
    line = one_line(err)
    assert rc == 2 and typed in line and meant in line, line


def test_service_install_names_the_agent_option_meant(capsys, home):
    rc, _, err = run(capsys, "service", "install", "--role", "verifier", "--modle", "tiny:1")
    line = one_line(err)
    assert rc == 2 and "--modle" in line and "did you mean --model?" in line


@pytest.mark.parametrize("argv,want", [
    (("generate", "hi", "--top-p", "2"), "--top-p must be in (0, 1]"),
    (("generate", "hi", "--temp", "-1"), "--temp must be >= 0"),
    (("generate", "hi", "--seed", "-3"), "--seed must be an integer"),
])
def test_a_bad_value_names_the_flag_not_the_api_field(capsys, home, argv, want):
    rc, _, err = run(capsys, *argv)
    line = one_line(err)
    assert rc == 2 and want in line
    assert "top_p" not in line and "temperature" not in line


@pytest.mark.parametrize("cmd", ["generate", "serve"])
@pytest.mark.parametrize("model,extra", [("llama3.2", ""), ("smollm", "did you mean smollm2?")])
def test_an_unknown_model_lists_what_works_and_what_a_hub_id_needs(capsys, home, cmd, model,
                                                                   extra):
    argv = ("generate", "hi") if cmd == "generate" else ("serve", "--port", "0")
    rc, _, err = run(capsys, *argv, "--model", model)
    line = one_line(err)
    assert rc == 2 and f"unknown model '{model}'" in line and "--model" in line
    for want in ("smollm2", "tiny:SEED", "PATH.gguf", "internet", "--allow-hub", extra):
        assert want in line, (want, line)


@pytest.mark.parametrize("argv", [("generate", "hi"), ("ls",), ("plan",), ("serve", "--port", "0"),
                                  ("bench", "--fleet"), ("agent", "--role", "verifier"),
                                  ("key", "export"), ("dash",),
                                  ("service", "install", "--role", "verifier")])
def test_a_key_file_that_does_not_exist_is_the_same_error_everywhere(capsys, home, tmp_path,
                                                                     argv):
    missing = tmp_path / "missing.key"
    wait = ("--wait", "0.1") if argv[0] in ("generate", "ls", "plan", "serve", "bench") else ()
    rc, _, err = run(capsys, *argv, "--key", str(missing), *wait)
    line = one_line(err)
    assert rc == 2 and f"--key {missing}: no such file" in line, line
    assert "macfleet keygen --key" in line


def test_ls_with_no_agents_points_at_agent_and_service_install_with_one_exit_status(
        capsys, home):
    assert run(capsys, "keygen")[0] == 0
    rc, _, err = run(capsys, "ls", "--wait", "0.2")
    line = one_line(err)
    assert rc == 1
    for want in ("no agents found", "macfleet service install", "macfleet agent",
                 "`macfleet up` starts a fleet on this machine only"):
        assert want in line, (want, line)
    rc, out, _ = run(capsys, "ls", "--wait", "0.2", "--json")
    assert rc == 1 and json.loads(out)["agents"] == []


def test_plan_with_no_agents_points_at_agent_and_service_install(capsys, home):
    run(capsys, "keygen")
    rc, _, err = run(capsys, "plan", "--wait", "0.2")
    line = one_line(err)
    assert rc == 2 and "macfleet service install" in line and "--simulate" in line


def test_keygen_names_the_command_that_copies_the_key(capsys, home):
    rc, out, _ = run(capsys, "keygen")
    assert rc == 0 and "macfleet key export | ssh mac2 macfleet key import" in out


@pytest.mark.slow
def test_generate_says_where_it_runs_and_why(capsys, home):
    argv = ("generate", "hi", "--model", "tiny:1", "--max-tokens", "2", "--no-chat")
    rc, _, err = run(capsys, *argv, "--local")
    assert rc == 0 and "macfleet: running in-process (--local)" in err, err
    rc, _, err = run(capsys, *argv)  # no fleet key on this machine
    assert rc == 0 and f"macfleet: no fleet key at {home / 'fleet.key'}" in err
    assert "running in-process" in err
    run(capsys, "keygen")
    rc, out, err = run(capsys, *argv, "--wait", "0.3", "--json")
    assert rc == 0
    (line,) = [ln for ln in err.splitlines() if ln.startswith("macfleet: ")]
    assert line.startswith("macfleet: no agents in fleet ") and " after 0.3 s: running " \
        "in-process; `--local` skips the wait" in line, line
    where = json.loads(out)["stats"]["where"]
    assert where["mode"] == "in-process" and where["why"] in line and where["fleet_id"] in line
