"""Progress of long work (model loading, distill stages, benchmark runs, export): a rich
progress bar on a terminal, plain lines at most every `every_s` seconds when the output is a
file or CI, so logs stay readable and never fill with carriage returns.

One object, `Bar`, for both: `update(done)` / `advance(n)` with a note, `log(line)` for a
message that stays (above the bar, or one plain line), `close()` for the final state. `bar()`
is the context-manager form; `runs()` counts benchmark runs through the `progress(msg)` callback
the benchmarks already take. Which mode: `want_bars` (MACFLEET_PROGRESS=bars|plain|off forces
one). Imports only the standard library and rich, so any layer may use it.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

DEFAULT_PLAIN_EVERY_S = 30.0  # a plain line at most this often (and at start and end)
MODES = ("auto", "bars", "plain", "off")
_live: list["Bar"] = []  # the rich bar on screen now (at most one)


def want_bars(stream: TextIO, environ: dict[str, str] | None = None) -> str:
    """'bars' on an interactive terminal, 'plain' for a file, a pipe or CI, 'off' if asked."""
    env = os.environ if environ is None else environ
    mode = env.get("MACFLEET_PROGRESS", "auto").lower()
    if mode in ("bars", "plain", "off"):
        return mode
    isatty = getattr(stream, "isatty", None)
    tty = bool(isatty and isatty())
    if not tty or env.get("CI") or env.get("TERM") == "dumb":
        return "plain"
    return "bars"


def _duration(s: float) -> str:
    if s != s or s == float("inf") or s < 0:
        return "?"
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60}:{s % 60:02d}"


def plain_line(description: str, done: float, total: float | None, unit: str, rate: float,
               elapsed: float, note: str = "", final: bool = False) -> str:
    """One plain progress line: what, how far, rate, and ETA (or the time taken, at the end)."""
    u = f" {unit}" if unit else ""
    if total is None and not unit and not done:  # a wait of unknown length: no counts
        return f"{description}: done in {_duration(elapsed)}" if final else f"{description} ..."
    if total:
        head = f"{description}: {done:,.0f}/{total:,.0f}{u} ({100 * min(done / total, 1):.0f}%)"
    else:
        head = f"{description}: {done:,.0f}{u}"
    parts = [head]
    if rate > 0:
        parts.append(f"{rate:,.1f}{u}/s" if rate < 10 else f"{rate:,.0f}{u}/s")
    if final:
        parts.append(f"in {_duration(elapsed)}")
    elif total and rate > 0:
        parts.append(f"ETA {_duration((total - done) / rate)}")
    else:
        parts.append(f"{_duration(elapsed)} elapsed")
    return "  ".join(parts) + (f"  {note}" if note else "")


class Bar:
    """One piece of long work with a known (or unknown, total=None) size."""

    def __init__(self, description: str, total: float | None = None, *, unit: str = "",
                 completed: float = 0, stream: TextIO | None = None, mode: str = "auto",
                 every_s: float = DEFAULT_PLAIN_EVERY_S,
                 report: Callable[[str], None] | None = None, transient: bool = False,
                 clock: Callable[[], float] = time.monotonic, announce: bool = True):
        self.stream = sys.stderr if stream is None else stream
        if report is not None and mode == "auto":
            mode = "plain"  # a caller that takes the lines itself gets plain ones
        self.mode = want_bars(self.stream) if mode == "auto" else mode
        if self.mode not in MODES[1:]:
            raise ValueError(f"progress mode {mode!r}: one of {', '.join(MODES)}")
        if self.mode == "bars" and _live:
            # rich draws one live display at a time: an inner bar's lines go above the outer
            self.mode, report = "plain", _live[-1].log
        self.description, self.total, self.unit = description, total, unit
        self.start, self.done, self.note = completed, completed, ""
        self.every_s, self.clock, self.transient = every_s, clock, transient
        self.report = report or self._print
        self.t0 = clock()
        self._last = float("-inf")
        self._closed = False
        self._rich = None
        if self.mode == "bars":
            self._start_rich()
        elif self.mode == "plain" and announce:
            self._emit(force=True)

    # -- rich -------------------------------------------------------------------------------
    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TaskProgressColumn, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        console = Console(file=self.stream, force_terminal=True)
        cols = [SpinnerColumn(), TextColumn("{task.description}", style="bold", markup=False), BarColumn(),
                MofNCompleteColumn() if self.total else TextColumn("{task.completed:,.0f}"),
                TextColumn(self.unit), TaskProgressColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[note]}", markup=False)]
        if not self.total and not self.unit:  # a wait: spinner, what, elapsed
            cols = [SpinnerColumn(), TextColumn("{task.description}", style="bold", markup=False),
                    TimeElapsedColumn(), TextColumn("{task.fields[note]}", markup=False)]
        self._rich = Progress(*cols, console=console, transient=self.transient)
        self._task = self._rich.add_task(self.description, total=self.total,
                                         completed=self.start, rate="", note="")
        self._rich.start()
        _live.append(self)
        atexit.register(self.close)  # an exception that ends the program: the cursor back

    def _rate(self) -> float:
        el = self.clock() - self.t0
        return (self.done - self.start) / el if el > 0 else 0.0

    def _rate_text(self) -> str:
        r = self._rate()
        if r <= 0:
            return ""
        u = f" {self.unit}" if self.unit else ""
        return f"{r:,.1f}{u}/s" if r < 10 else f"{r:,.0f}{u}/s"

    # -- plain ------------------------------------------------------------------------------
    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def _emit(self, force: bool = False, final: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        self.report(plain_line(self.description, self.done, self.total, self.unit,
                               self._rate(), now - self.t0, self.note, final))

    # -- the interface ----------------------------------------------------------------------
    def update(self, done: float, note: str | None = None, *, total: float | None = None,
               force: bool = False) -> None:
        self.done = done
        if note is not None:
            self.note = note
        if total is not None:
            self.total = total
        if self._rich is not None:
            kw = {"total": total} if total is not None else {}
            self._rich.update(self._task, completed=done, note=self.note,
                              rate=self._rate_text(), **kw)
        elif self.mode == "plain":
            self._emit(force=force)

    def rebase(self, done: float) -> None:
        """Count rate and ETA from `done` now (a resumed run jumps there; its earlier work is
        not this run's speed)."""
        self.start = self.done = done
        self.t0 = self.clock()
        if self._rich is not None:
            self._rich.reset(self._task, completed=done, total=self.total)

    def advance(self, n: float = 1, note: str | None = None) -> None:
        self.update(self.done + n, note)

    def log(self, line: str) -> None:
        """A message that stays: printed above the bar, or as its own plain line."""
        if self._rich is not None:
            self._rich.console.print(line, markup=False, highlight=False)
        elif self.mode == "plain":
            self.report(line)

    def close(self, done: float | None = None) -> None:
        """The final state (`done`: the count reached, when the last update did not say it)."""
        if self._closed:
            return
        self._closed = True
        if done is not None:
            self.done = done
        if self._rich is not None:
            atexit.unregister(self.close)
            if self in _live:
                _live.remove(self)
            self._rich.update(self._task, completed=self.done, rate=self._rate_text())
            self._rich.stop()
        elif self.mode == "plain":
            self._emit(force=True, final=True)


@contextmanager
def bar(description: str, total: float | None = None, **kw) -> Iterator[Bar]:
    b = Bar(description, total, **kw)
    try:
        yield b
    finally:
        b.close()


@contextmanager
def runs(description: str, total: int | None = None, **kw) -> Iterator[Callable[[str], None]]:
    """Benchmark runs: yields the `progress(msg)` callback benchmarks take; each message is one
    run done (kept as a line), the bar says how many are left."""
    with bar(description, total, unit="runs", **kw) as b:
        def progress(msg: str) -> None:
            b.log(msg)
            b.advance(1)
        yield progress


@contextmanager
def waiting(what: str, **kw) -> Iterator[Bar]:
    """Work of unknown length (loading a model): a spinner with the time elapsed that goes
    away when done, or one plain line with the time it took (none when it failed: the error
    is the line)."""
    b = Bar(what, None, transient=True, announce=False, **kw)
    try:
        yield b
    except BaseException:
        if b.mode == "plain":
            b._closed = True  # failed: the error says so, not a "done" line
        b.close()
        raise
    b.close()
