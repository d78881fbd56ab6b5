"""`bench disagg`'s reduction of what the clients saw: the short sessions' inter-token gaps in
the window from the long prompt's arrival to its first token (p50, p99, max, the largest and
when), before it, the long prompt's TTFT and KV flow; and the plot of results/disagg*.json.
Pure but for the plot (matplotlib when installed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Timed:
    """One request as its client saw it."""

    name: str
    submit_s: float  # relative to the round's start
    ttft_s: float  # submit -> first token
    gaps_s: tuple[float, ...]  # between token-carrying chunks
    tokens: int
    token_ids: tuple[int, ...]
    kv: dict


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def window_gaps(r: Timed, window: tuple[float, float]) -> tuple[list[float], list[float]]:
    """A short session's inter-token gaps that end inside the window, and those before it."""
    t = r.submit_s + r.ttft_s
    inside, before = [], []
    for g in r.gaps_s:
        t += g
        if window[0] <= t <= window[1]:
            inside.append(g)
        elif t < window[0]:
            before.append(g)
    return inside, before


def largest_gaps(runs: list[Timed], window: tuple[float, float], k: int = 10) -> list[dict]:
    """The k longest short-session gaps ending in the window: how long, when (s after the
    long prompt arrived), whose; where the p99 comes from."""
    out = []
    for r in runs:
        if not r.name.startswith("short"):
            continue
        t = r.submit_s + r.ttft_s
        for g in r.gaps_s:
            t += g
            if window[0] <= t <= window[1]:
                out.append({"ms": round(g * 1e3, 1), "at_s": round(t - window[0], 2),
                            "session": r.name})
    return sorted(out, key=lambda x: -x["ms"])[:k]


def summarize(runs: list[Timed], window: tuple[float, float]) -> dict:
    shorts = [r for r in runs if r.name.startswith("short")]
    long = next((r for r in runs if r.name == "long"), None)  # None: the control
    inside = [g for r in shorts for g in window_gaps(r, window)[0]]
    before = [g for r in shorts for g in window_gaps(r, window)[1]]
    p50, p99 = pct(inside, 0.5), pct(inside, 0.99)
    return {"window_s": round(window[1] - window[0], 3), "gaps_in_window": len(inside),
            "short_itl_before_s": {"p50": round(pct(before, 0.5), 4),
                                   "p99": round(pct(before, 0.99), 4), "gaps": len(before)},
            "short_itl_s": {"p50": round(p50, 4), "p99": round(p99, 4),
                            "max": round(max(inside, default=0.0), 4)},
            "p99_over_p50": round(p99 / p50, 2) if p50 else None,
            "long_ttft_s": long.ttft_s if long else None, "kv": long.kv if long else {},
            "largest_gaps": largest_gaps(runs, window),
            "requests": [asdict(r) | {"token_ids": None, "gaps_s": None} for r in runs]}


def plot(res: dict, path: Path) -> Path | None:
    """Per prompt size, the short sessions' p50/p99 inter-token gap in the window per mode
    (and the p50 before the long prompt arrived); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = res["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(max(7.5, 5.5 * len(sizes)), 5.0),
                             squeeze=False)
    for ax, size in zip(axes[0], sizes):
        modes = size["modes"]
        x = range(len(modes))
        p50 = [m["short_itl_s"]["p50"] * 1e3 for m in modes]
        p99 = [m["short_itl_s"]["p99"] * 1e3 for m in modes]
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50 in the window", color="tab:blue")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99 in the window", color="tab:orange")
        for i, m in enumerate(modes):
            before = m["short_itl_before_s"]
            ax.plot([i - 0.4, i + 0.4], [before["p50"] * 1e3] * 2, color="black", lw=1.5,
                    label="p50 before it arrived" if i == 0 else None)
            if "p99" in before:
                ax.plot([i - 0.4, i + 0.4], [before["p99"] * 1e3] * 2, color="black", lw=1,
                        ls="--", label="p99 before it arrived" if i == 0 else None)
            ax.text(i, p99[i], f"{m['p99_over_p50']}x\nTTFT {m['long_ttft_s']:.0f} s",
                    ha="center", va="bottom", fontsize=7)
        control = res.get("control")
        if control:
            ax.axhline(control["short_itl_s"]["p99"] * 1e3, color="tab:gray", lw=1, ls=":",
                       label=f"p99 with no long prompt (control, {control['p99_over_p50']}x "
                             "its p50)")
        busy = res.get("busy_control")
        if busy:
            ax.axhline(busy["short_itl_s"]["p99"] * 1e3, color="tab:red", lw=1, ls=":",
                       label=f"p99 with the prefill agent busy for the bench (control, "
                             f"{busy['p99_over_p50']}x its p50)")
        ax.margins(y=0.45)  # room for the labels and the legend above the bars
        ax.set_xticks(list(x))
        ax.set_xticklabels([m["mode"].replace(" (", "\n(") for m in modes], fontsize=7)
        ax.set_ylabel("short sessions' inter-token gap (ms)")
        ax.set_title(f"{size['prompt_tokens']:,}-token prompt arrives")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{res['short_sessions']} decoding sessions while a long prompt is prefilled\n"
                 "(goal: p99 <= 1.5x p50 with a prefill agent)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
