"""Pure pieces of the dashboard (formatting, sorting, histogram); its import layering is in
tests/test_layering.py."""

from __future__ import annotations

import dataclasses

import pytest

from macfleet.fleet.snapshot import StaticSource
from tui import app as app_module
from tui.format import clip, fmt_age, fmt_bytes, fmt_mem, fmt_ms
from tui.widgets.histogram import histogram_lines
from tui.widgets.hosts import HOST_SORTS, host_cells, sort_hosts
from tui_testkit import load


def test_formatters_are_short_and_handle_unknowns() -> None:
    assert [fmt_ms(x) for x in (None, 0.054, 12.34, 512.0, 45_000.0)] == \
        ["—", "0.05", "12.3", "512", "45s"]
    assert [fmt_bytes(x) for x in (12, 35_840, 3.2e6, 2e9)] == ["12B", "35.8kB", "3.2MB", "2.0GB"]
    assert fmt_mem(10 * 1024**3, 192 * 1024**3) == "10/192G 5%" and fmt_mem(1, 0) == "—"
    assert [fmt_age(x) for x in (None, 0.42, 42.0, 600.0, 9000.0)] == \
        ["—", "0.4s", "42s", "10m", "2h"]
    assert clip("Qwen2.5-7B-Instruct", 8) == "Qwen2.5…" and clip("abc", 8) == "abc"


def test_sort_hosts_puts_unknown_rtt_last() -> None:
    studio, air, mini = load("host_vanishes")[0].hosts
    unreachable = dataclasses.replace(mini, rtt_ms=None)
    by = {key: [h.name for h in sort_hosts([studio, air, unreachable], key)]
          for key in HOST_SORTS}
    assert by == {"name": ["air", "mini", "studio"], "rtt": ["studio", "air", "mini"],
                  "memory": ["air", "studio", "mini"], "load": ["studio", "air", "mini"]}


def test_dead_host_cells_say_so() -> None:
    dead = load("host_vanishes")[1].hosts[2]
    assert not dead.alive
    assert "DEAD" in [str(c) for c in host_cells(dead, compact=True)]
    assert "lost 4.2s" in [str(c) for c in host_cells(dead, compact=False)]
    assert len(host_cells(dead, compact=False)) == len(host_cells(dead, compact=True)) + 1


def test_histogram_lines_scale_to_width() -> None:
    lines = histogram_lines((2, 0, 8), width=30)
    assert [ln.split("│")[0] for ln in lines] == ["0 ", "1 ", "2 "]
    assert lines[2].count("█") == 30 - 1 - 1 - 9 and lines[1].count("█") == 0
    assert lines[0].count("█") == round(lines[2].count("█") / 4)
    assert all(len(ln) == len(lines[0]) for ln in lines) and lines[2].endswith(" 80%")
    assert histogram_lines((0, 0), width=20)[0].endswith("  —")


def test_run_dashboard_closes_the_source_even_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run(self: app_module.FleetDashboard) -> None:
        seen["refresh_s"] = self.refresh_s
        raise KeyboardInterrupt

    monkeypatch.setattr(app_module.FleetDashboard, "run", fake_run)
    src = StaticSource()
    with pytest.raises(KeyboardInterrupt):
        app_module.run_dashboard(src, refresh_s=0.5)
    assert seen == {"refresh_s": 0.5} and src._closed
