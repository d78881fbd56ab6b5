"""`macfleet bench overhead`: how much of the device's speed the decoding loop keeps.

Parts, on the same weights and prompts (the held-out prompts of `bench drafter`), greedy,
interleaved rounds after a warm-up round, each method's fastest timed round kept:
  (a) plain macfleet (the serving engine with one request, no drafter) against mlx-lm's
      `generate_step`;
      rates after the first token for both (what a streaming user sees);
  (b) the oracle drafter (bench/oracle.py: it drafts the run's own answer, so every
      draft is accepted) at fixed block lengths k, against plain macfleet: the measured
      speed-up over the ideal one read off the device's verify(L) curve,
      ideal(k) = (k + 1) * verify(1) / verify(k + 1): the loop's efficiency;
  (c) the default drafter (`auto`, through `generate_one`, text and all) against plain;
  (d) (b) and (a) on random-weight llamas in the shape of bigger models (bench/weights.py):
      the bandwidth-bound regime where a block costs about one token.
And a figure of its own: how often greedy block decoding departs from one-token decoding
(the oracle re-runs on its departed run's output until a run accepts every draft; each
departure's position is kept), per model and dtype.

This module holds the pure parts (summaries, ideal speed-ups, departures, the device's tag);
bench/overhead_run.py runs the models.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from macfleet.bench import geomean

PARTS = ("a", "b", "c", "d")
DEFAULT_KS = (1, 3, 7, 15)
DEFAULT_MAX_ITERATIONS = 4


@dataclass(frozen=True)
class Run:
    """One generation, timed."""

    tokens: tuple[int, ...]  # the answer (prompt excluded)
    decode_tps: float  # tokens / (wall time after the prompt was processed)
    stream_tps: float  # tokens after the first commit / time after the first commit
    drafted: int = 0
    accepted: int = 0

    @property
    def all_accepted(self) -> bool:
        return self.accepted == self.drafted


@dataclass(frozen=True)
class OracleTrace:
    """How the oracle reached an answer block decoding commits unchanged."""

    reference: tuple[int, ...]  # the answer the last run committed (drafted, all accepted)
    departures: tuple[int, ...]  # per departed run: where it left its reference (answer index)
    converged: bool  # the last run committed its reference exactly

    @property
    def runs(self) -> int:
        return len(self.departures) + (1 if self.converged else 0)


def first_departure(reference: Sequence[int], answer: Sequence[int]) -> int | None:
    """Index of the first token where `answer` differs from `reference` (a shorter or longer
    answer departs where the shorter ends); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, answer)):
        if a != b:
            return i
    return None if len(reference) == len(answer) else min(len(reference), len(answer))


def follow_reference(run: Callable[[tuple[int, ...]], Sequence[int]], plain: Sequence[int],
                     max_runs: int = DEFAULT_MAX_ITERATIONS) -> OracleTrace:
    """Run the oracle on `plain` (one-token decoding's answer); while the run departs from its
    reference, run again on that run's own answer; at most `max_runs` runs."""
    ref, deps = tuple(plain), []
    for _ in range(max_runs):
        out = tuple(run(ref))
        d = first_departure(ref, out)
        if d is None:
            return OracleTrace(ref, tuple(deps), True)
        deps.append(d)
        ref = out
    return OracleTrace(ref, tuple(deps), False)


def ideal_speedup(verify_ms: Mapping[int, float], k: int) -> float:
    """Tokens/s of blocks of k accepted drafts over one-token steps, if the loop cost nothing
    but the forward: (k + 1) * verify(1) / verify(k + 1)."""
    return (k + 1) * verify_ms[1] / verify_ms[k + 1]


def best(runs: Sequence[Run], attr: str = "decode_tps") -> float:
    return max((getattr(r, attr) for r in runs), default=0.0)


def ratio_summary(num: Mapping[str, float], den: Mapping[str, float]) -> dict:
    """Per-prompt ratios num/den, their geometric mean and the lowest (pure)."""
    per = {p: round(num[p] / den[p], 3) for p in num if p in den and den[p] > 0}
    vals = list(per.values())
    return {"geomean": round(geomean(vals), 3), "min": min(vals) if vals else None,
            "per_prompt": per}


def oracle_summary(speedups: Mapping[str, float], verify_ms: Mapping[int, float], k: int,
                   all_accepted: bool) -> dict:
    """The oracle at block length k: measured speed-up over plain (geomean of prompts), the
    ideal one from verify(L), and their ratio (the loop's efficiency)."""
    s = ratio_summary(speedups, {p: 1.0 for p in speedups})
    ideal = ideal_speedup(verify_ms, k)
    return {"k": k, "speedup_geomean": s["geomean"], "speedup_min": s["min"],
            "ideal_speedup": round(ideal, 3),
            "efficiency": round(s["geomean"] / ideal, 3) if ideal else None,
            "all_accepted": all_accepted, "per_prompt": s["per_prompt"]}


def departure_summary(traces: Mapping[str, OracleTrace]) -> dict:
    """How often the first oracle run left one-token decoding's answer, and where (pure)."""
    firsts = {key: t.departures[0] for key, t in traces.items() if t.departures}
    return {"runs": len(traces), "departed": len(firsts),
            "rate": round(len(firsts) / len(traces), 3) if traces else None,
            "first_positions": dict(sorted(firsts.items())),
            "not_converged": sorted(k for k, t in traces.items() if not t.converged),
            "max_runs_used": max((t.runs for t in traces.values()), default=0)}


def device_tag(device: str, gpu_name: str = "", chip: str = "") -> str:
    """`cpu`, or a short name of the accelerator: `h100`, `h200`, `m2-max`, else `gpu`."""
    if "cpu" in device.lower():
        return "cpu"
    for name in (gpu_name, chip):
        m = re.search(r"\bApple (M\d+)(?: (Pro|Max|Ultra))?", name or "")
        if m:
            return "-".join(x.lower() for x in m.groups() if x)
        m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name or "")
        if m:
            return m.group(1).lower()
    return "gpu"


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"block lengths must be whole numbers separated by commas: {text!r}")
    if not ks or ks[0] < 1 or ks[-1] > 63:
        raise ValueError(f"block lengths must be 1..63, got {text!r}")
    return ks


def parse_skip(text: str) -> frozenset[str]:
    out = frozenset(x.strip() for x in text.split(",") if x.strip())
    bad = sorted(out - set(PARTS))
    if bad:
        raise ValueError(f"--skip takes parts among {', '.join(PARTS)}, got {bad}")
    return out


def curve(section: Mapping) -> dict[int, float]:
    """A section's verify(L) in ms by L (int keys also after a JSON round trip)."""
    return {int(L): float(ms) for L, ms in section["verify_ms"].items()}


def headline(section: Mapping) -> list[str]:
    """The lines printed for one measured model (pure)."""
    n = section["params"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"
    out = [f"{section['label']} ({section['weights']}, {size} params): "
           f"verify(1) {curve(section).get(1, float('nan')):.1f} ms"]
    ps = section.get("pipelined_vs_synchronous")
    if ps:
        out.append(f"  plain pipelined / synchronous: {ps['geomean']}x geomean (min {ps['min']}x)")
    a = section.get("plain_vs_mlx")
    if a:
        out.append(f"  (a) plain macfleet / mlx-lm generate_step: {a['geomean']}x geomean "
                   f"(min {a['min']}x)")
    a = section.get("sampled_plain_vs_mlx")
    if a:
        out.append(f"      sampled (device draw) / mlx-lm's sampler: {a['geomean']}x geomean "
                   f"(min {a['min']}x)")
    for o in section.get("oracle", []):
        out.append(f"  (b) oracle k={o['k']}: {o['speedup_geomean']}x of plain, ideal "
                   f"{o['ideal_speedup']}x, efficiency {o['efficiency']}"
                   + ("" if o["all_accepted"] else " (some drafts rejected)"))
    c = section.get("default_drafter")
    if c:
        out.append(f"  (c) default drafter {c['spec']}: {c['speedup']['geomean']}x of plain "
                   f"(min {c['speedup']['min']}x)")
        for what, r in c.get("engine_vs_loop", {}).items():
            out.append(f"      {what} through the serving engine: {r['geomean']}x the "
                       f"single-session loop (min {r['min']}x)")
    d = section.get("departures")
    if d and d["runs"]:
        out.append(f"  block decoding left one-token decoding in {d['departed']} of {d['runs']} "
                   f"runs (first positions {list(d['first_positions'].values())})")
    return out


def plot(doc: Mapping, out) -> bool:
    """verify(L)/verify(1) per model, and the oracle's speed-up against the ideal per k."""
    from macfleet.bench.record import pyplot

    plt = pyplot()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, s in enumerate(doc["sections"]):
        color = f"C{i}"
        vm = curve(s)
        ls = sorted(vm)
        ax1.plot(ls, [vm[L] / vm[1] for L in ls], "o-", color=color, ms=3,
                 label=s["label"])
        orc = s.get("oracle", [])
        if orc:
            ks = [o["k"] for o in orc]
            ax2.plot(ks, [o["speedup_geomean"] for o in orc], "o-", color=color,
                     label=f"{s['label']}: measured")
            ax2.plot(ks, [o["ideal_speedup"] for o in orc], "x--", color=color, alpha=0.6,
                     label=f"{s['label']}: ideal")
    ax1.set(xlabel="block length L", ylabel="verify(L) / verify(1)", title="verify(L)")
    ax2.set(xlabel="drafts per block k (oracle: all accepted)",
            ylabel="tokens/s over plain macfleet", title="oracle drafter vs ideal")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"bench overhead on {doc['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True
