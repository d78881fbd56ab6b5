"""One verify(L) measurement a test run, not one in every process (imported by name).

Every process that serves a model on the in-process engine (a `serve --local` server, a
verifier agent, `generate`, `demo`'s fleet) needs the model's verify(L) table, measured once
per machine and kept in macfleet's cache (engine/verify_costs.py) -- except on a busy machine,
where the product keeps a table in the process that measured it only (a loaded machine's
timings are skewed). The suite's machine is always busy (two workers on two cores), so every
such process measured its own: ~11 s of CPU each for smollm2 on a loaded 2-core box (a served
first request 12 -> 1.7 s of the server's CPU with a kept table).

`keep_verify_table` measures it in this process (once: memoised) and writes it to the test
run's throwaway cache (MACFLEET_CACHE, tests/conftest.py) even so; every later process of the
run that loads the model reads it. What a test checks does not depend on the table's numbers:
they steer drafters and block lengths, and greedy output is plain decoding's whichever runs
(sampled output: distribution-identical)."""

from __future__ import annotations

import json
import os


def keep_verify_table(spec: str = "smollm2", *, load: bool = True):
    """`spec`'s table kept in the run's cache (measured in this process unless an earlier
    one of the run kept it: .ci/test does for the default suite); the loaded model, or None
    when load is False and the table was kept already (no model loaded)."""
    from macfleet.engine import verify_costs as vc
    from macfleet.engine.cachedir import write_atomic
    from macfleet.engine.models import load_model

    kept = vc.cache_dir() / f"kept-{spec.replace(':', '-')}"
    if kept.is_file() and not load:
        return None
    lm = load_model(spec)
    path = vc.table_path(lm.model)
    if "MACFLEET_CACHE" in os.environ and not path.is_file():
        table = vc.verify_costs(lm.model)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(table))
    if "MACFLEET_CACHE" in os.environ:
        kept.touch()
    return lm


if __name__ == "__main__":  # .ci/test, before the default suite: `python tests/verify_table.py`
    import sys

    from macfleet.engine.models import embedded_model_path

    if "MACFLEET_CACHE" not in os.environ:
        sys.exit("verify_table.py: MACFLEET_CACHE must name the run's throwaway cache")
    if embedded_model_path() is not None:
        keep_verify_table(sys.argv[1] if len(sys.argv) > 1 else "smollm2", load=False)
