"""Refreshing a DataTable in place, so a once-a-second update keeps cursor and scroll."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import DataTable

Cell = str | Text
Row = tuple[str, Sequence[Cell]]  # (row key, cells)


def row_keys(table: DataTable) -> list[str]:
    """Row keys in display order."""
    return [str(row.key.value) for row in table.ordered_rows]


def sync_rows(table: DataTable, rows: Sequence[Row]) -> None:
    """Make ``table`` show ``rows``, in that order.

    Same keys in the same order: cells are updated in place (no flicker, scroll kept).
    Otherwise the table is rebuilt and the cursor follows its row key if it survived,
    because a selection that jumps on every refresh makes a live table unusable.
    """
    keys = [key for key, _ in rows]
    current = row_keys(table)
    if keys == current:
        for r, (_, cells) in enumerate(rows):
            for c, value in enumerate(cells):
                table.update_cell_at(Coordinate(r, c), value, update_width=True)
        return
    selected = current[table.cursor_row] if 0 <= table.cursor_row < len(current) else None
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    if selected in keys:
        table.move_cursor(row=keys.index(selected), animate=False)
