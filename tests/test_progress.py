"""macfleet/progress.py in both modes: rich bars on a terminal (a forced-terminal console into
a buffer), plain periodic lines (rate, ETA, the time taken) for files and CI; which mode is
chosen, and that no carriage-return progress line is left in the package."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from macfleet import progress

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_the_mode_follows_the_output_and_can_be_forced():
    assert progress.want_bars(Tty(), {"TERM": "xterm"}) == "bars"
    assert progress.want_bars(io.StringIO(), {}) == "plain"  # a file or a pipe
    assert progress.want_bars(Tty(), {"CI": "true"}) == "plain"
    assert progress.want_bars(Tty(), {"TERM": "dumb"}) == "plain"
    assert progress.want_bars(io.StringIO(), {"MACFLEET_PROGRESS": "bars"}) == "bars"
    assert progress.want_bars(Tty(), {"MACFLEET_PROGRESS": "off"}) == "off"
    with pytest.raises(ValueError):
        progress.Bar("x", 1, stream=io.StringIO(), mode="fancy")


def test_plain_lines_are_periodic_with_rate_eta_and_the_time_taken():
    out, clock = io.StringIO(), Clock()
    b = progress.Bar("answers", 1000, unit="tok", stream=out, mode="plain", every_s=30,
                     clock=clock)
    for i in range(1, 11):
        clock.t += 5
        b.update(i * 50, note=f"batch {i}")
    b.close(520)  # the count reached after the last update
    b.close()  # idempotent
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # the start, one line per 30 s of 50 s, the end
    assert lines[0] == "answers: 0/1,000 tok (0%)  0:00 elapsed"
    assert lines[1] == "answers: 300/1,000 tok (30%)  10 tok/s  ETA 1:10  batch 6"
    assert lines[-1] == "answers: 520/1,000 tok (52%)  10 tok/s  in 0:50  batch 10"
    assert len(lines) == 3


def test_plain_lines_count_from_where_a_resumed_run_started():
    out, clock = io.StringIO(), Clock()
    b = progress.Bar("answers", 1000, unit="tok", completed=600, stream=out, mode="plain",
                     every_s=0, clock=clock)
    clock.t += 10
    b.update(700)
    assert out.getvalue().splitlines()[-1].startswith("answers: 700/1,000 tok (70%)  10 tok/s"
                                                      "  ETA 0:30")


def test_a_resumed_run_counts_its_rate_from_where_it_resumed():
    from macfleet.cli.cmd_distill import _steps

    out, clock = io.StringIO(), Clock()
    b = progress.Bar("train", 1000, unit="steps", stream=out, mode="plain", every_s=0,
                     clock=clock)
    on_step = _steps(b)
    clock.t += 50  # loading the checkpoint
    on_step(501, 1000)  # resumed at step 500
    clock.t += 10
    on_step(511, 1000)
    assert out.getvalue().splitlines()[-1] == "train: 511/1,000 steps (51%)  1.1 steps/s  ETA 7:25"


def test_a_wait_says_what_then_how_long():
    out, clock = io.StringIO(), Clock()
    with progress.waiting("loading smollm2", stream=out, mode="plain", clock=clock):
        clock.t += 2.4
    assert out.getvalue().splitlines() == ["loading smollm2: done in 0:02"]


def test_a_failed_wait_prints_nothing_the_error_is_the_line():
    """A CLI error stays one line (tests/cli/test_generate.py): no "done" for a load that
    failed, no start line before it."""
    out = io.StringIO()
    with pytest.raises(ValueError):
        with progress.waiting("loading nope.gguf", stream=out, mode="plain"):
            raise ValueError("no GGUF file at nope.gguf")
    assert out.getvalue() == ""


def test_benchmark_runs_are_counted_and_their_messages_kept():
    out = io.StringIO()
    with progress.runs("bench local", 3, stream=out, mode="plain", every_s=1e9) as say:
        say("short mlx: 20.0 tok/s")
        say("short ngram: 30.0 tok/s")
    text = out.getvalue()
    assert "short mlx: 20.0 tok/s\n" in text and "short ngram: 30.0 tok/s\n" in text
    assert text.splitlines()[-1].startswith("bench local: 2/3 runs (67%)")


def test_report_takes_the_plain_lines_and_off_prints_nothing():
    got = []
    b = progress.Bar("x", 2, report=got.append, every_s=0, stream=Tty())
    b.advance()
    b.close()
    assert b.mode == "plain" and len(got) == 3
    out = Tty()
    b = progress.Bar("x", 2, stream=out, mode="off")
    b.advance()
    b.log("hello")
    b.close()
    assert out.getvalue() == ""


def test_a_terminal_gets_a_rich_bar_with_rate_and_eta():
    out = Tty()
    b = progress.Bar("answers", 100, unit="tok", stream=out, mode="bars")
    b.update(40, note="batch [3]")  # brackets are text, not rich markup
    b.log("a message that stays")
    b.update(100)
    b.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # colours and cursor moves
    assert "answers" in text and "100/100" in text and "tok" in text
    assert "━" in text  # the bar
    assert "ETA" in text and "a message that stays" in text and "batch [3]" in text
    assert "tok/s" in text


def test_a_bar_inside_a_bar_prints_its_lines_above_the_outer_one():
    out = Tty()
    with progress.bar("bench", 2, unit="runs", stream=out, mode="bars") as outer:
        with progress.waiting("loading tiny:1", stream=out, mode="bars", every_s=0) as inner:
            assert inner.mode == "plain"  # rich refuses two live displays at once
        outer.advance()
    assert "loading tiny:1: done in" in out.getvalue()
    assert progress._live == []


def test_a_rich_wait_goes_away_when_done():
    out = Tty()
    with progress.waiting("loading smollm2", stream=out, mode="bars"):
        pass
    assert "\x1b[" in out.getvalue()  # drawn, then erased (transient)


def test_no_hand_written_carriage_return_progress_is_left():
    offenders = []
    for path in (ROOT / "macfleet").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""["']\\r(?!\\n)""", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert not offenders, offenders


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_distill_data_shows_a_bar_on_a_terminal_and_plain_lines_in_a_log(tmp_path):
    """`macfleet distill --stage data` as a user runs it: a rich bar with rate and ETA when
    forced to a terminal (MACFLEET_PROGRESS=bars), plain lines with no carriage return into a
    file; the model loading is reported in both."""
    import os
    import subprocess
    import sys

    procs = {}
    for mode in ("bars", "auto"):
        env = dict(os.environ, MACFLEET_PROGRESS=mode, MACFLEET_NO_OPENBLAS="1")
        env.pop("CI", None)
        procs[mode] = subprocess.Popen(
            [sys.executable, "-m", "macfleet", "distill", "--model", "tiny:1", "--tokens", "64",
             "--gen-batch", "4", "--max-tokens", "32", "--dataset", str(tmp_path / mode),
             "--stage", "data"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    out = {m: p.communicate(timeout=500) for m, p in procs.items()}
    for m, p in procs.items():
        assert p.returncode == 0, out[m][1][-2000:]
    bars = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out["bars"][1])
    assert "━" in bars and "answers" in bars and "ETA" in bars and "tokens/s" in bars
    plain = out["auto"][1]  # stderr is a pipe here: plain lines
    assert "\r" not in plain and "━" not in plain
    assert "loading tiny:1 ..." not in plain and "loading tiny:1: done in" in plain
    assert re.search(r"^answers: \d+/64 tokens \(100%\)  [\d.,]+ tokens/s  in \d+:\d\d", plain,
                     re.M), plain
