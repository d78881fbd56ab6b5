"""Horizontal bar chart of accepted tokens per block (gpt-fast's headline statistic)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

BAR = "█"


def histogram_lines(hist: Sequence[int], width: int) -> list[str]:
    """One line per accepted length ``i``: ``' 2 │████████    31  24%'``.

    Bars scale to the largest count so the shape stays readable at any width.
    """
    total = sum(hist)
    peak = max(hist, default=0)
    label_w = len(str(max(len(hist) - 1, 0)))
    count_w = len(str(peak))
    bar_w = max(1, width - label_w - count_w - 9)
    lines = []
    for i, n in enumerate(hist):
        bar = BAR * (round(bar_w * n / peak) if peak else 0)
        pct = f"{100 * n / total:3.0f}%" if total else "  —"
        lines.append(f"{i:>{label_w}} │{bar:<{bar_w}} {n:>{count_w}} {pct}")
    return lines


class AcceptHistogram(Widget):
    """``hist[i]`` = blocks that accepted ``i`` draft tokens; a wide right tail means the
    draft length could grow, a tall bar at 0 means it should shrink."""

    DEFAULT_CSS = "AcceptHistogram { height: auto; }"

    hist: reactive[tuple[int, ...]] = reactive(tuple, layout=True)

    def render(self) -> Text:
        if not self.hist or not sum(self.hist):
            return Text("no blocks yet", "dim italic")
        text = Text()
        for n, line in enumerate(histogram_lines(self.hist, self.size.width or 40)):
            text.append(line + "\n", "green" if n else "yellow")
        text.rstrip()
        return text

    def get_content_height(self, container: object, viewport: object, width: int) -> int:
        return max(1, len(self.hist))
