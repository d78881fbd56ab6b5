"""Helpers for the dashboard tests: recorded fixtures, waiting, and screen text.

(A uniquely named module, not ``helpers``, so it cannot clash with other test folders.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from textual.app import App
from textual.pilot import Pilot

from macfleet.fleet.snapshot import FleetSnapshot, read_jsonl

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAST_REFRESH_S = 0.02  # the worker polls this often; stall notice after 3 periods


def load(name: str) -> list[FleetSnapshot]:
    """A recorded scenario from ``fixtures/`` (see make_fixtures.py)."""
    return read_jsonl(FIXTURES / f"{name}.jsonl")


async def wait_until(pilot: Pilot, predicate: Callable[[], bool], timeout_s: float = 5.0,
                     what: str = "condition") -> None:
    """Let the app run until ``predicate()`` holds; the worker thread is real, so a few
    event-loop turns may pass before its message lands."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.01)
    await pilot.pause()  # let the refresh triggered by the change run


def screen_text(app: App) -> str:
    """What the terminal shows, as plain text lines.

    Uses the compositor's strips (private API of Textual 8.x): the only way to assert
    that something is *visible* at 80x24, not merely present in a widget.
    """
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(seg.text for seg in strip) for strip in strips)




async def wait_visible(pilot: Pilot, app: App, *texts: str, present: bool = True,
                       timeout_s: float = 5.0) -> str:
    """Wait until every one of ``texts`` is (or, with ``present=False``, is not) on screen;
    returns the screen text.  Mounts and layout settle over a few event-loop turns."""
    def ok() -> bool:
        screen = screen_text(app)
        return all((t in screen) == present for t in texts)

    try:
        await wait_until(pilot, ok, timeout_s, what=f"{texts} {'on' if present else 'off'} screen")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- screen ---\n{screen_text(app)}") from None
    return screen_text(app)


class FakeClock:
    """Wall clock the test moves by hand, for stall detection without sleeping."""

    def __init__(self, t: float = 1_767_225_600.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
