"""The README's table of current figures says what its results files hold: each figure shown is
read off the file and field named in its row, so re-recording a result without updating the
README (or editing a figure by hand) fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from macfleet.bench.drafter import FLOOR  # the bench's rule for the best fixed drafter

ROOT = Path(__file__).resolve().parents[1]


def _table() -> dict[str, str]:
    """results file -> the text of the README table's rows that name it."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if line.startswith("| ") and "](results/" in line:
            name = line.split("](results/", 1)[1].split(")", 1)[0]
            rows[name] = rows.get(name, "") + line
    return rows


def _serve(d: dict, mode: str, clients: int) -> float:
    return next(r["tokens_per_s"] for r in d["throughput"][mode] if r["clients"] == clients)


def _agents_overhead(d: dict) -> list[float]:
    return [m["multihost_overhead"] for p in d["prompts"].values()
            for name, m in p["methods"].items() if name.startswith("agents[")]


def _disagg_p50(d: dict, prompt_tokens: int) -> dict[str, float]:
    size = next(s for s in d["sizes"] if s["prompt_tokens"] == prompt_tokens)
    return {m["mode"]: m["short_itl_s"]["p50"] for m in size["modes"]}


def _pair(d: dict, width: int, target: float, kind: str = "layers") -> dict:
    """A setting's figures; `kind`: the dial that set its acceptance (rows written before the
    draft dial were the layer dial's)."""
    return next(r["figures"] for r in d["settings"] if r["width"] == width
                and r["target"] == target and r.get("dial_kind", "layers") == kind)


def _greedy_f1_f2(d: dict) -> list[float]:
    return [f["extra_ms"] for f in d["encryption"]["smollm2_flows"]
            if f["flow"] in ("F1", "F2") and "probs" not in f["what"]]


# (results file, what the README row shows, computed from the file)
FIGURES = [
    ("drafter.json", "**1.15x**",
     lambda d: f"**{d['best_in_process']['speedup_geomean']:.2f}x**"),
    ("drafter.json", "**1.28x**", lambda d: f"**{d['best_agents']['speedup_geomean']:.2f}x**"),
    ("drafter.json", "drafter (`eagle`)", lambda d: f"drafter (`{d['best_in_process']['spec']}`)"),
    ("drafter.json", "agents (`eagle+retrieval+ngram`)",
     lambda d: f"agents (`{d['best_agents']['spec']}`)"),
    ("fleet_spec.json", "at most 1.0%", lambda d: f"at most {max(_agents_overhead(d)):.1%}"),
    ("overhead-cpu.json", "1.04x",
     lambda d: f"{d['sections'][0]['plain_vs_mlx']['geomean']:.2f}x"),
    ("serve.json", "111.2 tok/s", lambda d: f"{_serve(d, 'batched', 16):.1f} tok/s"),
    ("serve.json", "(14.2)", lambda d: f"({_serve(d, 'batched', 1):.1f})"),
    ("serve.json", "7.8x one client",
     lambda d: f"{_serve(d, 'batched', 16) / _serve(d, 'batched', 1):.1f}x one client"),
    ("serve.json", "1.15x `mlx_lm.server` (96.4)",
     lambda d: f"{_serve(d, 'batched', 16) / _serve(d, 'mlx_lm_server', 16):.2f}x "
               f"`mlx_lm.server` ({_serve(d, 'mlx_lm_server', 16):.1f})"),
    ("serve_h2h.json", "1.22x", lambda d: f"{d['summary']['ratio_median']:.2f}x"),
    ("batch_identity.json", "0 of 200 differ",
     lambda d: f"{d['modes']['flat']['diverged']} of {d['requests']} differ"),
    ("disagg.json", "108 ms a token (p50) with a prefill agent, 301 ms",
     lambda d: f"{_disagg_p50(d, 8000)['prefill agent (auto)'] * 1e3:.0f} ms a token (p50) "
               f"with a prefill agent, {_disagg_p50(d, 8000)['verifier alone'] * 1e3:.0f} ms"),
    ("pair.json", "**4.84x** plain decoding",
     lambda d: f"**{_pair(d, 15104, 0.95)['two agents / plain']['geomean']:.2f}x** plain decoding"),
    ("pair.json", "**1.42x** the pair in series",
     lambda d: f"**{_pair(d, 5120, 0.8)['two agents / in-process draft model']['geomean']:.2f}x**"
               " the pair in series"),
    ("pair.json", "**2.66x** plain decoding through the fleet",
     lambda d: f"**{_pair(d, 15104, 0.8)['two agents / verifier agent alone']['geomean']:.2f}x**"
               " plain decoding through the fleet"),
    ("pair.json", "**1.61x** plain decoding through the fleet (the verifier agent alone; "
     "worst prompt 1.25x",
     lambda d: "**{:.2f}x** plain decoding through the fleet (the verifier agent alone; worst "
               "prompt {:.2f}x".format(
                   _pair(d, 15104, 0.6, "draft")["two agents / verifier agent alone"]["geomean"],
                   _pair(d, 15104, 0.6, "draft")["two agents / verifier agent alone"]["min"])),
    ("serve_prediction.json", "**2.50x** (5 requests; a regenerated answer 3.67x; a useless "
     "prediction 0.96x, worst 0.91x; 21 of 21",
     lambda d: "**{:.2f}x** ({} requests; a regenerated answer {:.2f}x; a useless prediction "
               "{:.2f}x, worst {:.2f}x; {} of {}".format(
                   d["summary"]["by_held_share"]["held>=0.8"]["speedup_geomean"],
                   d["summary"]["by_held_share"]["held>=0.8"]["requests"],
                   d["summary"]["regenerate"]["speedup_geomean"],
                   d["summary"]["useless"]["speedup_geomean"],
                   d["summary"]["useless"]["speedup_min"],
                   d["summary"]["same_answers"], d["summary"]["requests"])),
    ("prediction-plain/serve_prediction.json",
     "**1.76x** (3 files, every one >= 1.43x; held >= 80%: 7.45x; 12 of 12",
     lambda d: "**{:.2f}x** (3 files, every one >= {:.2f}x; held >= 80%: {:.2f}x; {} of {}".format(
         d["summary"]["copy"]["speedup_geomean"], d["summary"]["copy"]["speedup_min"],
         d["summary"]["by_held_share"]["held>=0.8"]["speedup_geomean"],
         d["summary"]["same_answers"], d["summary"]["requests"])),
    ("pair.json", "**1.29x** the pair in series in one process (its ceiling at the measured "
     "costs: 1.37x)",
     lambda d: f"**{_pair(d, 5120, 0.95)['two agents / in-process draft model']['geomean']:.2f}x"
               "** the pair in series in one process (its ceiling at the measured costs: "
               f"{_pair(d, 5120, 0.95)['two agents / in-process draft model']['ceiling']:.2f}x)"),
    ("fleet_first.json", "| **0.99x** |",
     lambda d: f"| **{d['first_request']['first_over_warm']:.2f}x** |"),
    ("drafter-auto-1201b/repeats/drafter.json",
     "best fixed drafter of the same run (`retrieval+ngram`: the best geomean of those that stay "
     ">= 0.95x plain on every prompt, the bench's rule) | **1.009x** (1.46x plain decoding, "
     "slowest prompt 0.995x",
     lambda d: f"best fixed drafter of the same run (`{d['auto_vs_best_fixed']['best_fixed']}`: "
               f"the best geomean of those that stay >= {FLOOR:.2f}x plain on every prompt, "
               "the bench's rule) "
               f"| **{d['auto_vs_best_fixed']['auto_vs_best_geomean']:.3f}x** "
               f"({d['auto_vs_best_fixed']['auto_speedup_geomean']:.2f}x plain decoding, "
               f"slowest prompt {d['auto_vs_best_fixed']['auto_speedup_min']:.3f}x"),
    ("security.json", "+0.005 ms a message",
     lambda d: f"+{max(_greedy_f1_f2(d)):.3f} ms a message"),
]


@pytest.mark.parametrize("name,shown,computed", FIGURES,
                         ids=[f"{n}:{s}" for n, s, _ in FIGURES])
def test_each_readme_figure_is_what_its_results_file_holds(name, shown, computed):
    rows = _table()
    assert name in rows, f"the README's figures table names no results/{name}"
    assert shown in rows[name], f"{shown!r} not in the README row for results/{name}"
    assert computed(json.loads((ROOT / "results" / name).read_text())) == shown


def test_every_results_file_the_table_names_exists():
    for name in _table():
        assert (ROOT / "results" / name).is_file(), name
