"""Hosts panel: every agent with its chip, roles, models, memory, load and liveness."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from macfleet.fleet.snapshot import HostView
from tui.format import clip, fmt_age, fmt_mem, fmt_ms
from tui.widgets.table import sync_rows

log = logging.getLogger(__name__)

HOST_SORTS = ("name", "rtt", "memory", "load")
EMPTY_TEXT = "no agents discovered yet"

_SORT_KEYS: dict[str, Callable[[HostView], Any]] = {
    "name": lambda h: h.name.lower(),
    # unknown RTT sorts last: a host we cannot reach is the least interesting "near" host
    "rtt": lambda h: (h.rtt_ms is None, h.rtt_ms or 0.0, h.name.lower()),
    "memory": lambda h: (-h.mem_fraction, h.name.lower()),
    "load": lambda h: (-h.load, h.name.lower()),
}


def sort_hosts(hosts: Sequence[HostView], key: str) -> list[HostView]:
    """Hosts in display order for sort ``key`` (one of ``HOST_SORTS``)."""
    return sorted(hosts, key=_SORT_KEYS[key])


def host_cells(h: HostView, compact: bool = False) -> list[str | Text]:
    """One table row; a dead host is red and says so, rather than silently vanishing.

    ``compact`` (narrow terminals) drops the chip column and shortens the rest so an
    80-column screen shows every remaining column without scrolling sideways.
    """
    style = "" if h.alive else "red"
    mark = Text("● ", "green") if h.alive else Text("✗ ", "bold red")
    if h.alive:
        hb = fmt_age(h.heartbeat_age_s)
    else:
        hb = "DEAD" if compact else f"lost {fmt_age(h.heartbeat_age_s)}"
    mem = fmt_mem(h.mem_used, h.mem_total)
    cells = [clip(",".join(h.roles), 9 if compact else 16),
             clip(",".join(h.models), 16 if compact else 28),
             mem.split(" ")[0] if compact else mem, f"{h.load:.2f}", hb, fmt_ms(h.rtt_ms)]
    if not compact:
        cells.insert(0, clip(h.chip, 12))
    name = mark + Text(clip(h.name, 10 if compact else 16), style)
    return [name] + [Text(c, "bold red" if c == "DEAD" else style) for c in cells]


class HostsPanel(Vertical):
    """Table of hosts, or the empty-fleet notice when discovery has found nobody."""

    COLUMNS = ("host", "chip", "roles", "models", "memory", "load", "hb", "rtt")
    COMPACT_BELOW = 100  # panel width (cells) under which the compact columns are used

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.compact: bool | None = None  # decided on the first resize
        self._hosts: Sequence[HostView] = ()
        self._sort = HOST_SORTS[0]

    def compose(self) -> ComposeResult:
        yield DataTable(id="hosts-table", cursor_type="row", zebra_stripes=True)
        yield Static(EMPTY_TEXT, id="hosts-empty", classes="empty")

    def on_mount(self) -> None:
        self._set_compact(self.size.width < self.COMPACT_BELOW)

    def on_resize(self) -> None:
        self._set_compact(self.size.width < self.COMPACT_BELOW)

    def _set_compact(self, compact: bool) -> None:
        if compact == self.compact:
            return
        self.compact = compact
        table = self.query_one(DataTable)
        table.clear(columns=True)
        table.add_columns(*(c for c in self.COLUMNS if not (compact and c == "chip")))
        self.show(self._hosts, self._sort)

    def show(self, hosts: Sequence[HostView], sort: str) -> None:
        """Replace the rows with ``hosts`` in ``sort`` order; vanished hosts disappear."""
        self._hosts, self._sort = hosts, sort
        table = self.query_one(DataTable)
        ordered = sort_hosts(hosts, sort)
        rows = [(h.node_id, host_cells(h, bool(self.compact))) for h in ordered]
        sync_rows(table, rows)
        table.display = bool(ordered)
        self.query_one("#hosts-empty").display = not ordered
        dead = sum(not h.alive for h in hosts)
        self.border_title = (f"Hosts ({len(hosts)}{f', {dead} dead' if dead else ''})"
                             f" · sort: {sort}")
