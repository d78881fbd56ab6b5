"""`macfleet bench pair`: a big verifier and a real draft model, on one Mac and on two.

What it measures (issue 42), for each setting of the instrument (a wide SmolLM2 verifier,
bench/pair_model.py, whose draft-model acceptance is set by a dial; the draft model is the real
SmolLM2-135M), one Mac = one core:
(a) plain decoding, macfleet against mlx-lm's `generate_step`;
(b) the draft model in one process (drafting in series), macfleet against mlx-lm's
    `speculative_generate_step`, same pair, same k;
(c) two agents -- the verifier on core 0, a draft-model agent drafting ahead on core 1 -- against
    (b), and (d) against plain decoding and against the verifier agent alone;
beside each figure the speed-up that the measured costs and acceptance allow (`ceilings`), how
far ahead the draft agent ran and the share of its drafts thrown away. Greedy ids must be
identical across every run of a prompt.

This module is the arithmetic (pure); bench/pair_run.py runs the models and agents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from macfleet.bench import geomean
from macfleet.engine.controller import expected_tokens
from macfleet.engine.verify_costs import verify_ms_at

# Ordinary requests, none of them in the dial's calibration set (bench/pair_dial.py).
PAIR_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short Python function that returns the largest number in a list.",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Describe how a bicycle works to a ten-year-old.",
    "List five fruits that are rich in vitamin C.",
    "Why do we have seasons on Earth?",
    "Write a haiku about autumn leaves.",
)
DEFAULT_TOKENS = 96
DEFAULT_K = 4
MAX_CEILING_K = 16


@dataclass(frozen=True)
class Costs:
    """Measured on the core the run uses: verify(L) of the verifier in ms by L, and one
    draft-model token in ms."""

    verify_ms: Mapping[int, float]
    draft_ms: float

    def verify(self, L: int) -> float:
        """verify(L), linearly between (and beyond) the measured lengths."""
        return verify_ms_at(self.verify_ms, L)

    @property
    def c(self) -> float:
        """The cost ratio: one draft token / one verify(1)."""
        return self.draft_ms / self.verify(1)


def alpha_from_mean(mean_accepted: float, k: int) -> float:
    """Per-token acceptance a whose E[accepted drafts of a k-block] = mean_accepted: solves
    sum_{i=1..k} a^i = mean_accepted by bisection (0 <= mean <= k)."""
    m = max(0.0, min(float(k), mean_accepted))
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        got = sum(a ** i for i in range(1, k + 1))
        lo, hi = (a, hi) if got < m else (lo, a)
    return (lo + hi) / 2


def one_process_speedup(alpha: float, k: int, costs: Costs) -> float:
    """The standard formula: drafting in series, a block costs k draft steps + verify(k+1)."""
    return expected_tokens(alpha, k) * costs.verify(1) / (k * costs.draft_ms + costs.verify(k + 1))


def two_agent_speedup(alpha: float, k: int, costs: Costs) -> float:
    """Drafting ahead on a second machine at full overlap: a block costs the longer of its
    verify(k+1) and the k+1 draft steps the draft agent needs to stay ahead (k drafts and its
    guess of the verifier's next token); a refuted stream's restart is not counted, so this is
    a ceiling."""
    t = max(costs.verify(k + 1), (k + 1) * costs.draft_ms)
    return expected_tokens(alpha, k) * costs.verify(1) / t


def best_two_agent(alpha: float, costs: Costs, k_max: int = MAX_CEILING_K) -> tuple[int, float]:
    """The k with the highest two-agent ceiling, and that ceiling."""
    return max(((k, two_agent_speedup(alpha, k, costs)) for k in range(1, k_max + 1)),
               key=lambda kv: kv[1])


def ratios(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-prompt ratios of two runs' tokens/s: geomean, min, max, and each."""
    rs = [a / b for a, b in zip(num, den) if a > 0 and b > 0]
    return {"geomean": geomean(rs), "min": min(rs, default=0.0), "max": max(rs, default=0.0),
            "each": rs}


def _rates(runs: Sequence[dict], name: str) -> list[float]:
    return [r[name]["tok_s"] for r in runs]


def _strip(ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return ids


def identical(one: dict | None, two: dict | None, eos: Sequence[int] = ()) -> bool:
    """Greedy ids of every run of each prompt are the same (mlx-lm's answers keep their end
    token, macfleet's do not)."""
    by_prompt: dict[str, list[list[int]]] = {}
    for part in (one, two):
        for r in (part or {}).get("runs", []):
            for name, v in r.items():
                if name != "prompt" and v.get("ids") is not None:
                    by_prompt.setdefault(r["prompt"], []).append(_strip(v["ids"], eos))
    for rnd in ((two or {}).get("sessions") or {}).get("rounds", []):
        for a in rnd["answers"]:  # batched with others: the same answer as alone
            by_prompt.setdefault(a["prompt"], []).append(_strip(a["ids"], eos))
    return all(all(x == xs[0] for x in xs) for xs in by_prompt.values())


def sessions_figure(two: Mapping) -> tuple[str, dict] | None:
    """`bench pair --sessions N`: the figure of its rounds of N requests at once, drafted
    ahead over the verifier agent alone round by round (None: not run)."""
    s = two.get("sessions")
    if not s:
        return None
    rate = {spec: [r["tok_s"] for r in s["rounds"] if r["spec"] == spec]
            for spec in ("none", "draft")}
    return (f"two agents, {s['n']} sessions at once / verifier agent alone",
            ratios(rate["draft"], rate["none"]))


def summarize(*, width: int, target: float, dial: Mapping, k: int, one: dict | None,
              two: dict | None, eos: Sequence[int] = ()) -> dict:
    """One setting's row of results/pair.json: the figures of issue 42 with their ceilings."""
    eos = eos or (one or {}).get("eos", ())
    out: dict = {"width": width, "target": target, "eps": dial.get("eps"),
                 "extra_layers": dial.get("extra_layers"),
                 "dial_kind": dial.get("kind", "layers"),
                 "draft_noise": dial.get("draft_noise", 0.0),
                 "identical": identical(one, two, eos), "figures": {}}
    fig = out["figures"]
    costs = None
    if one is not None:
        c = one["costs"]
        costs = Costs({int(L): float(v) for L, v in c["verify_ms"].items()}, c["draft_ms"])
        runs = one["runs"]
        drafted = sum(r["spec"]["drafted"] for r in runs)
        accepted = sum(r["spec"]["accepted"] for r in runs)
        alpha = alpha_from_mean(accepted / max(drafted / k, 1), k)
        out.update(c=costs.c, alpha=alpha, verify_ms={str(L): v for L, v in
                                                      costs.verify_ms.items()},
                   draft_ms=costs.draft_ms)
        has_plain = all("plain" in r for r in runs)  # bench pair --skip plain: not run
        if has_plain:
            fig["plain macfleet / mlx-lm plain"] = ratios(_rates(runs, "plain"),
                                                          _rates(runs, "mlx_plain"))
        fig["in-process draft model / mlx-lm speculative"] = ratios(
            _rates(runs, "spec"), _rates(runs, "mlx_spec"))
        if has_plain:
            fig["in-process draft model / plain"] = {
                **ratios(_rates(runs, "spec"), _rates(runs, "plain")),
                "ceiling": one_process_speedup(alpha, k, costs)}
            fig["mlx-lm speculative / mlx-lm plain"] = {
                **ratios(_rates(runs, "mlx_spec"), _rates(runs, "mlx_plain")),
                "ceiling": one_process_speedup(alpha, k, costs)}
    if two is not None:
        runs2 = two["runs"]
        pair = _rates(runs2, "pair")
        ceiling_k, ceiling = best_two_agent(out.get("alpha", target), costs) if costs \
            else (None, None)
        # the verifier agent alone is plain decoding through the fleet: the same ceiling
        fig["two agents / verifier agent alone"] = {
            **ratios(pair, _rates(runs2, "agent_alone")), "ceiling": ceiling,
            "ceiling_k": ceiling_k}
        if one is not None:
            by = {r["prompt"]: r for r in one["runs"]}
            spec = [by[r["prompt"]]["spec"]["tok_s"] for r in runs2]
            if all("plain" in by[r["prompt"]] for r in runs2):
                plain = [by[r["prompt"]]["plain"]["tok_s"] for r in runs2]
                fig["two agents / plain"] = {**ratios(pair, plain), "ceiling": ceiling,
                                             "ceiling_k": ceiling_k}
            else:  # no one-process plain runs: plain decoding is the verifier agent's
                fig["in-process draft model / verifier agent alone"] = {
                    **ratios(spec, _rates(runs2, "agent_alone")),
                    "ceiling": one_process_speedup(out["alpha"], k, costs)}
            fig["two agents / in-process draft model"] = {
                **ratios(pair, spec),
                "ceiling": ceiling / one_process_speedup(out["alpha"], k, costs)}
        at_once = sessions_figure(two)
        if at_once is not None:
            fig[at_once[0]] = at_once[1]
        n = len(runs2)
        out["pair_agents"] = {
            "lead": sum(r["pair"]["lead"] for r in runs2) / n,
            "waste": sum(r["pair"]["waste"] for r in runs2) / n,
            "wait_ms": sum(r["pair"]["wait_ms"] for r in runs2) / n,
            "mean_accepted": sum(r["pair"]["accepted"] for r in runs2)
            / max(sum(r["pair"]["blocks"] for r in runs2), 1),
            "failures": sum(r["pair"]["failures"] for r in runs2),
            "verify_ms_per_block": sum(r["pair"].get("verify_ms_per_block", 0.0)
                                       for r in runs2) / n,
            "block_ms": sum(r["pair"].get("block_ms", 0.0) for r in runs2) / n,
            # the draft agent's compute per token in the stream, beside the probe's draft_ms
            # (one forward of the draft model on its core, alone)
            "agent_token_ms": sum(r["pair"].get("agent_token_ms", 0.0) for r in runs2) / n}
    out["one"], out["two"] = one, two
    return out


def with_alone(two: dict, alone: Mapping[str, Mapping]) -> dict:
    """Two-agent runs with the verifier-agent-alone runs of another setting of the same width
    filled in where they were not measured (as `with_plain`: ids kept apart)."""
    return {**two, "runs": [r if "agent_alone" in r else
                            {**r, "agent_alone": {**alone[r["prompt"]], "ids": None}}
                            for r in two["runs"]]}


def with_plain(one: dict, plain: Mapping[str, Mapping]) -> dict:
    """One-process runs with the plain runs of another setting of the same width filled in
    where they were not measured (their speed is the shapes', not the weights'; their ids are
    the other verifier's, so they are kept apart from the identity check: `plain_from`)."""
    runs = []
    for r in one["runs"]:
        if "plain" in r:
            runs.append(r)
        else:
            runs.append({**r, **{n: {**v, "ids": None} for n, v in plain[r["prompt"]].items()}})
    return {**one, "runs": runs}
