"""`generate --json` through a fleet whose verifiers all fail: the tokens already received are
printed (with the reason), not lost."""

from __future__ import annotations

import argparse
import json

import pytest

from macfleet.cli import cmd_generate
from macfleet.cli.common import UserError


def test_tokens_received_before_the_last_verifier_died_are_printed(monkeypatch, capsys):
    def replanning(args, key, committed):
        committed.ids.extend([5, 6, 7])
        committed.text.extend(["a", "b"])
        raise UserError("no verifier could finish the generation")

    monkeypatch.setattr(cmd_generate, "_replanning", replanning)
    monkeypatch.setattr("macfleet.fleet.keys.resolve_key", lambda *a, **k: b"k" * 32)
    p = argparse.ArgumentParser()
    cmd_generate.add_parser(p.add_subparsers())
    args = p.parse_args(["generate", "hi", "--json", "--proposer", "none", "--model", "tiny:1"])
    with pytest.raises(UserError):
        args.func(args)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"text": "ab", "token_ids": [5, 6, 7], "complete": False,
                   "error": "no verifier could finish the generation"}
