"""`macfleet bench serve --prediction`: OpenAI Predicted Outputs against `serve --local`
(results/serve_prediction.json; issue 43).

Code-edit and copy workloads on the source files of bench/prediction_sources.py (100-400
lines each; `--lines N` keeps their first N lines for a short run), greedy, through the
`openai` package:

    copy           "repeat this code exactly", the file as the prediction
    edit           "rename X to Y, write the whole file", the original file as the prediction
                   (what an editor sends: the text it has)
    edit-guess     the same instruction, the edited file as the prediction
    useless        "repeat this code", another file as the prediction
    complete-copy  /v1/completions: a one-shot copy prompt (a short function, "Copy:", the same
                   function; then the file and "Copy:"), the file as the prediction: the
                   embedded 135M model copies a file asked this way more than in a chat
    complete-edit  the same with "With `X` renamed to `Y`:", the original file as the
                   prediction (the answer departs from it where it renames)
    regenerate     the copy question asked again with the first answer as the prediction (a
                   client that regenerates, or re-asks after a small change): an answer that
                   follows its prediction all along, whatever the model makes of the question

Each request runs without a prediction and then with one, on the same server (no prompt cache,
so both prefill the whole prompt); with `--repeats N`, N times each way, in alternating order
after the first pair (plain, predicted, predicted, plain, ...), and the speed-up is the ratio
of the medians: one run a request cannot tell a 0.95x from a 0.91x on a box whose two runs of
the same request differ by several percent. Per request: the
speed-up (wall time without / with), whether the answers are the same (greedy: they must be),
the verifier steps saved (without / with: a ratio the machine's load does not move), the
share of the answer's characters the prediction held (difflib's matching blocks: what a
drafter that follows the prediction perfectly could copy), the prediction's tokens accepted
and rejected (`usage.completion_tokens_details`) and the verifier steps (`usage.macfleet`).
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import time
from collections.abc import Callable

from macfleet.bench import geomean
from macfleet.bench.prediction_sources import SOURCES
from macfleet.bench.serve import FleetServer, start_server, stop_server

WORKLOADS = ("copy", "edit", "edit-guess", "useless", "complete-copy", "complete-edit",
             "regenerate")
COMPLETIONS = ("complete-copy", "complete-edit")  # asked on /v1/completions, the rest in chat
ANSWER = None  # a request's prediction is the answer to the same request without one
FLEET_BATCH = 16  # --fleet: the verifier agent's batch sessions (bench serve --fleet's)

# the one-shot example of the completion prompts: a copy, or the same rename, of a function
SHOT = "def add(a, b):\n    total = a + b\n    return total\n"
SHOT_RENAME = ("total", "result")


def _fenced(lang: str, code: str) -> str:
    return f"```{lang}\n{code}```"


def one_shot(lang: str, code: str, rename: tuple[str, str] | None = None) -> str:
    """A completion prompt (pure) whose continuation is `code` copied, or with `rename`'s
    identifier renamed: one short example of the same, then `code` and the opening fence
    (the answer is asked to stop at the closing one)."""
    def how(r):
        return "Copy:" if r is None else f"With `{r[0]}` renamed to `{r[1]}`:"

    shot_rename = None if rename is None else SHOT_RENAME
    shot = SHOT if rename is None else SHOT.replace(*SHOT_RENAME)
    return (f"Original:\n{_fenced('python', SHOT)}\n{how(shot_rename)}\n"
            f"{_fenced('python', shot)}\n\nOriginal:\n{_fenced(lang, code)}\n{how(rename)}\n"
            f"```{lang}\n")


def requests(lines: int | None = None, workloads=WORKLOADS) -> list[dict]:
    """Every (file, workload): its question (`ask`: a chat message, or a completion prompt
    where `endpoint` says so) and its prediction (ANSWER: the answer without one)."""
    files = [(n, lang, _cut(code, lines), ren) for n, lang, code, ren in SOURCES]
    out = []
    for i, (name, lang, code, (old, new)) in enumerate(files):
        other = files[(i + 1) % len(files)][2]
        edited = re.sub(rf"\b{re.escape(old)}\b", new, code)
        copy = f"Repeat this code exactly, without any change:\n{_fenced(lang, code)}"
        edit = (f"Rename `{old}` to `{new}` everywhere in this code and write out the whole "
                f"file:\n{_fenced(lang, code)}")
        for w, (ask, pred) in {"copy": (copy, code), "edit": (edit, code),
                               "edit-guess": (edit, edited), "useless": (copy, other),
                               "complete-copy": (one_shot(lang, code), code),
                               "complete-edit": (one_shot(lang, code, (old, new)), code),
                               "regenerate": (copy, ANSWER)}.items():
            if w in workloads:
                out.append({"file": name, "workload": w, "ask": ask, "prediction": pred,
                            "endpoint": "completions" if w in COMPLETIONS else "chat"})
    return out


def _cut(code: str, lines: int | None) -> str:
    return code if lines is None else "".join(code.splitlines(True)[:lines])


def held_share(answer: str, prediction: str) -> float:
    """The share of the answer's characters found in the prediction, in order (difflib)."""
    if not answer:
        return 0.0
    sm = difflib.SequenceMatcher(None, answer, prediction, autojunk=False)
    return round(sum(b.size for b in sm.get_matching_blocks()) / len(answer), 3)


def ask(client, model: str, question: str, max_tokens: int, prediction: str | None,
        endpoint: str = "chat") -> dict:
    """One greedy answer: its text, time and usage (`endpoint`: chat, or completions with
    `question` as the prompt)."""
    extra = ({"extra_body": {"prediction": {"type": "content", "content": prediction}}}
             if prediction else {})
    t0 = time.perf_counter()
    if endpoint == "completions":
        r = client.completions.create(model=model, prompt=question, max_tokens=max_tokens,
                                      temperature=0, stop=["```"], **extra)
    else:
        r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                           messages=[{"role": "user", "content": question}],
                                           **extra)
    s = time.perf_counter() - t0
    u = r.usage
    d, mine = u.completion_tokens_details, (u.model_extra or {}).get("macfleet") or {}
    c = r.choices[0]
    text = c.text if endpoint == "completions" else c.message.content
    return {"text": text or "", "s": round(s, 3),
            "tokens": u.completion_tokens, "finish_reason": r.choices[0].finish_reason,
            "accepted_prediction": (d.accepted_prediction_tokens or 0) if d else 0,
            "rejected_prediction": (d.rejected_prediction_tokens or 0) if d else 0,
            "verify_steps": mine.get("verify_steps", 0)}


def pair_order(repeats: int) -> list[bool]:
    """Pure: which run of a request has the prediction, in order. The first pair is plain then
    predicted (`regenerate` predicts the first plain answer); then the order alternates, so a
    drift of the machine's speed over the runs weighs on both sides alike."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    out = [False, True]
    for i in range(1, repeats):
        out += [True, False] if i % 2 else [False, True]
    return out


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def bench_prediction(model: str, *, proposer: str = "ngram", lines: int | None = None,
                     max_tokens: int = 1024, workloads=WORKLOADS, deadline: float = math.inf,
                     fleet: bool = False, repeats: int = 1,
                     progress: Callable[[str], None] = lambda m: None) -> dict:
    """Every request without and with its prediction on one `serve --local`, or (fleet) on
    `serve` in front of a local fleet (`macfleet up`: a verifier and a proposer agent)."""
    import openai

    cap = ("--max-tokens-cap", str(max_tokens))
    if fleet:
        server = FleetServer(model, FLEET_BATCH, proposer, *cap)
        url, stop = server.url, server.stop
    else:
        # no prompt cache: the request with a prediction would find the one without's prompt
        proc, url = start_server(model, "--proposer", proposer, *cap, "--prompt-cache-mb", "0")
        stop = functools.partial(stop_server, proc)
    rows = []
    try:
        client = openai.OpenAI(base_url=url, api_key="none", timeout=3600, max_retries=0)
        ask(client, model, "Say hello.", 4, "Hello!")  # warm-up (first forwards, verify(L))
        for req in requests(lines, workloads):
            if time.monotonic() > deadline:
                progress("time limit reached")
                break
            if fleet:  # the verifier agent keeps a prompt cache: both requests find the prompt
                ask(client, model, req["ask"], 1, None, req["endpoint"])
            runs: dict[bool, list[dict]] = {False: [], True: []}
            predicted = req["prediction"]
            for with_prediction in pair_order(repeats):
                if with_prediction and predicted is ANSWER:
                    predicted = runs[False][0]["text"]
                runs[with_prediction].append(ask(client, model, req["ask"], max_tokens,
                                                 predicted if with_prediction else None,
                                                 req["endpoint"]))
            plain, pred = runs[False][0], runs[True][0]
            plain_s = _median([r["s"] for r in runs[False]])
            pred_s = _median([r["s"] for r in runs[True]])
            row = {"file": req["file"], "workload": req["workload"],
                   "speedup": round(plain_s / pred_s, 3) if pred_s else None,
                   "steps_ratio": round(plain["verify_steps"] / pred["verify_steps"], 3)
                   if pred["verify_steps"] else None,
                   "same_answer": len({r["text"] for r in runs[False] + runs[True]}) == 1,
                   "plain_s": [r["s"] for r in runs[False]],
                   "predicted_s": [r["s"] for r in runs[True]],
                   "held_share": held_share(plain["text"], predicted),
                   "accepted_share": round(pred["accepted_prediction"] / pred["tokens"], 3)
                   if pred["tokens"] else 0.0,
                   "plain": plain, "predicted": pred}
            rows.append(row)
            progress(f"{req['file']} {req['workload']}: {row['speedup']}x ({row['steps_ratio']}x "
                     f"fewer verifier steps), held "
                     f"{row['held_share']:.0%}, accepted {row['accepted_share']:.0%} of "
                     f"{pred['tokens']} tokens, same answer {row['same_answer']}")
    finally:
        stop()
    return {"model": model, "proposer": proposer, "lines": lines, "max_tokens": max_tokens,
            "repeats": repeats,
            "server": "serve in front of macfleet up --agents 2" if fleet else "serve --local",
            "rows": rows, "summary": summary(rows)}


def _geomean(xs: list[float]) -> float | None:
    return round(geomean(xs), 3) if any(xs) else None


def summary(rows: list[dict]) -> dict:
    """Per workload: speed-up geomean and minimum, held and accepted shares; and the rows by
    held share (over 0.8, 0.5-0.8, under 0.5): how the speed-up follows it."""
    out: dict = {"same_answers": sum(r["same_answer"] for r in rows), "requests": len(rows)}
    for w in WORKLOADS:
        mine = [r for r in rows if r["workload"] == w]
        if mine:
            out[w] = {"speedup_geomean": _geomean([r["speedup"] for r in mine]),
                      "steps_ratio_geomean": _geomean([r.get("steps_ratio") for r in mine]),
                      "speedup_min": min(r["speedup"] or 0 for r in mine),
                      "held_share_mean": round(sum(r["held_share"] for r in mine) / len(mine),
                                               3),
                      "accepted_share_mean": round(sum(r["accepted_share"] for r in mine)
                                                   / len(mine), 3)}
    bands = {"held>=0.8": (0.8, 1.01), "held 0.5-0.8": (0.5, 0.8), "held<0.5": (0.0, 0.5)}
    out["by_held_share"] = {
        name: {"requests": len(sel), "speedup_geomean": _geomean([r["speedup"] for r in sel])}
        for name, (lo, hi) in bands.items()
        for sel in [[r for r in rows if lo <= r["held_share"] < hi]]}
    return out


def prediction_rows(res: dict) -> list[str]:
    s = res["summary"]
    out = [f"{'workload':<14}{'speed-up':>9}{'min':>7}{'steps':>8}{'held':>7}{'accepted':>10}"]
    for w in WORKLOADS:
        if w in s:
            x = s[w]
            out.append(f"{w:<14}{x['speedup_geomean']!s:>8}x{x['speedup_min']!s:>7}"
                       f"{x['steps_ratio_geomean']!s:>7}x{x['held_share_mean']:>7.0%}"
                       f"{x['accepted_share_mean']:>10.0%}")
    for name, b in s["by_held_share"].items():
        sp = f"{b['speedup_geomean']}x" if b["speedup_geomean"] else "n/a"
        out.append(f"{name}: {b['requests']} requests, speed-up {sp}")
    out.append(f"same answers: {s['same_answers']}/{s['requests']}")
    return out
