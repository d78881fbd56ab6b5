"""Mutation testing of the core (see docs/testing.md): mutmut over one module at a time, each
against only the fast tests that exercise it.

mutmut reads its settings from [tool.mutmut] of the pyproject.toml in its working directory and
writes its mutants there, so each module gets a scratch directory (.mutation/<name>/) holding
links to the packages and tests, and a pyproject.toml with that module's own settings. A
module's surviving mutants (with their diffs) are written to .mutation/<name>.json; triage them
into results/mutation.json.

    .venv/bin/python .ci/mutation.py [--fresh] [NAME ...]

NAME: a key of MODULES (none: all, in priority order); --fresh: forget earlier results;
--export: only write .mutation/<name>.json from the results so far (of a run that was stopped).
A MODULES entry may name functions (`f`, `Class.method`): only their mutants run and count.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"

# name -> (file to mutate, the fast tests that exercise it[, only these functions]). Priority
# order: the acceptance decisions, the codec, the KV rollback, KV shipping, token trees, the
# rest. (The host acceptance rules left macfleet for tests/reference_rules.py, issue 49: the
# tests' reference, not mutated; `residual` went to tree.py.)
MODULES: dict[str, tuple] = {
    # a block's accept decisions (the serving engine's), against their own tests (the engine
    # that calls them is covered by the greedy-identity and chi-square runs)
    "block": ("macfleet/engine/block.py", ["tests/engine/test_block.py"]),
    # the device-side acceptance, against its fast unit tests: not whole generations
    # (seconds each) nor the 6,000-trial device chi-square tests (test_sampling_lossless.py,
    # ~10 s each), which the piecewise tests here stand in for (gumbel_pick's own chi-square)
    "pipeline": ("macfleet/engine/pipeline.py", [
        *(f"tests/engine/test_pipeline.py::{t}" for t in (
            "test_greedy_outcome_is_accept_greedy",
            "test_every_outcome_is_int32",
            "test_rejection_rows_are_the_residual_or_p_where_it_is_empty",
            "test_gumbel_pick_draws_each_row_from_its_normalised_weights",
            "test_device_ratio_test_keeps_drafts_the_verifier_likes_more_and_corrects_the_"
            "first_miss",
            "test_device_ratio_correction_comes_from_the_residual",
            "test_device_ratio_test_is_seeded_per_position",
            "test_device_ratio_test_at_its_exact_boundaries",
            "test_rows_past_the_block_change_no_device_decision",
            "test_device_tree_draws_are_keyed_by_depth_like_plain_steps",
            "test_device_tree_of_a_root_alone_and_of_one_draft")),
        "tests/engine/test_sampling_lossless.py::test_device_ratio_test_at_its_boundaries",
        "tests/engine/test_sampling_lossless.py::"
        "test_device_draws_are_keyed_by_position_not_by_block",
        "tests/engine/test_tree.py::test_device_tree_sampling_walks_the_drawn_children"]),
    "codec": ("bridge/codec.py", ["tests/bridge/test_codec.py", "tests/bridge/test_codec_paths.py",
                                    "tests/bridge/test_fuzz_codec.py"]),
    "verifier": ("macfleet/engine/verifier.py", ["tests/engine/test_kv_rollback.py",
                                                  "tests/engine/test_verify_costs.py"]),
    # the batch's KV rollback (a row's trim, a tree's kept path; engine/batch_kv.py since the
    # store left batch.py), not the whole of the store, against the tests of the rollback itself
    # (the batched-equals-alone runs take minutes each)
    "batch_rollback": ("macfleet/engine/batch_kv.py", [
        *(f"tests/engine/test_batch.py::{t}" for t in (
            "test_keep_paths_moves_each_rows_kept_nodes_behind_its_root_in_one_call",
            "test_a_row_rolls_back_at_most_what_it_holds_and_says_how_much",
            "test_batch_kv_rows_copy_and_roll_back",
            "test_flat_forward_trees_match_the_single_session_tree_forward")),
        *(f"tests/engine/test_batch_kv.py::{t}" for t in (
            "test_a_row_keeps_its_tree_path_behind_the_root",
            "test_a_prefix_copies_between_rows_and_rolls_back_in_o1",
            "test_trim_cache_rolls_back_layer_lists_too"))],
        ["RowCache.trim", "trim_cache", "BatchKV.keep_paths", "BatchKV._move"]),
    "kvship": ("macfleet/engine/kvship.py", ["tests/engine/test_kvship.py"]),
    # kvship's layout helpers alone (their mutants each ran every test of the file), against
    # the fast tests that read a layout or price a codec
    "kvship_layout": ("macfleet/engine/kvship.py", [
        f"tests/engine/test_kvship.py::{t}" for t in (
            "test_a_layout_reads_heads_head_dim_and_dtype_and_prices_each_codec",
            "test_layout_and_bytes", "test_int8_and_float16_sizes",
            "test_a_bfloat16_cache_ships_exactly_as_float32",
            "test_slices_hold_as_many_whole_layers_as_max_bytes_allows",
            "test_assembler_refuses_gaps_overlaps_and_wrong_shapes",
            "test_assembler_checks_int8_scales_and_reports_what_is_missing",
            "test_installed_cache_equals_computed_bitwise",
            "test_install_refuses_another_depth")],
        ["KVLayout.bytes_per_token", "layout_of", "_itemsize", "_dtype_name"]),
    # the tree's data and rules, against test_tree.py's unit tests (not its tree forwards and
    # tree loops: seconds each) and the rerooting test of test_pipeline.py
    "tree": ("macfleet/engine/tree.py", [
        *(f"tests/engine/test_tree.py::{t}" for t in (
            "test_merge_shares_prefixes_and_masks_ancestors",
            "test_multi_draft_sampling_keeps_the_verifier_distribution",
            "test_device_tree_sampling_walks_the_drawn_children",
            "test_first_n_nodes_of_a_tree_are_a_tree",
            "test_tree_drafts_merge_with_chains_paths_per_leaf_and_candidates_with_their_rows",
            "test_the_first_node_of_a_tree_is_the_root_alone_and_candidates_are_cut_too",
            "test_depths_and_the_longest_branch_of_a_draft_tree",
            "test_specinfer_at_its_boundaries",
            "test_tree_sampling_without_probabilities_follows_the_drawn_child")),
        "tests/engine/test_sampling_lossless.py::test_residual",
        "tests/engine/test_pipeline.py::test_reroot_keeps_the_subtree_under_the_guessed_token",
        "tests/engine/test_pipeline.py::test_a_draft_made_ahead_is_taken_only_on_its_path_and_"
        "rerooted_with_its_rows"]),
    # sampling.py against its own tests and the host rules' (which draw with `sample`), not the
    # device chi-square runs of test_sampling_lossless.py (a minute each on the loaded box: they
    # check pipeline.py's sampled acceptance; device_probs is checked against the host transform)
    "sampling": ("macfleet/engine/sampling.py", ["tests/engine/test_sampling_params.py", *(
        f"tests/engine/test_sampling_lossless.py::{t}" for t in (
            "test_accept_ratio_first_token_is_distributed_as_p",
            "test_accept_exact_sample_first_token_is_distributed_as_p",
            "test_chi_square_rejects_broken_ratio_rules",
            "test_chi_square_rejects_broken_exact_rule", "test_residual",
            "test_accept_ratio_certain_cases", "test_accept_ratio_at_its_boundaries",
            "test_sample_matches_distribution_and_skips_zero_mass",
            "test_make_rng_is_seeded_per_stream", "test_top_p_filter_keeps_minimal_nucleus",
            "test_top_p_filter_rows_are_independent",
            "test_probs_from_logits_temperature_and_top_p",
            "test_acceptance_module_is_pure", "test_device_ratio_test_at_its_boundaries",
            "test_device_draws_are_keyed_by_position_not_by_block",
            "test_device_probs_match_the_host_transform"))]),
    # a group of drafters and its tree of drafts (moved out of the tree loop, which is now the
    # tests' reference, tests/reference_loops.py): its part-by-part tests
    "proposer_group": ("macfleet/engine/proposers/group.py", [
        "tests/engine/proposers/test_group.py",
        "tests/engine/test_batch.py::test_cap_total_cuts_the_largest_draft_lengths_first"]),
    # the flat forward against its direct tests (flat_forward/flat_layers beside each session
    # alone), not the serving engine's batched-equals-alone runs (minutes each)
    "batch": ("macfleet/engine/batch.py", [
        "tests/engine/test_flat_batch.py",
        *(f"tests/engine/test_batch.py::{t}" for t in (
            "test_flat_forward_rows_match_each_session_alone",
            "test_flat_forward_trees_match_the_single_session_tree_forward",
            "test_batch_kv_rows_copy_and_roll_back")),
        "tests/engine/proposers/eagle/test_draft_chains.py::test_chains_drafted_together_are_"
        "the_chains_drafted_alone"]),
    # the rest of the store (rows, growth, writes, prefix copies, installs): batch_rollback
    # has its rollback
    "batch_kv": ("macfleet/engine/batch_kv.py", [
        "tests/engine/test_batch_kv.py",
        "tests/engine/test_flat_batch.py::test_hidden_rows_and_logits_follow_each_segment_"
        "across_two_stores",
        *(f"tests/engine/test_batch.py::{t}" for t in (
            "test_flat_forward_rows_match_each_session_alone",
            "test_batch_kv_rows_copy_and_roll_back"))],
        ["BatchKV.__init__", "BatchKV.open", "BatchKV.close", "BatchKV.open_rows",
         "BatchKV.reserve", "BatchKV._buffers", "BatchKV.copy_prefixes", "BatchKV.install",
         "BatchKV._scatter", "BatchKV.write", "BatchKV.slot_index", "BatchKV.state",
         "RowCache.__init__", "RowCache.close"]),
}
LINKED = ("macfleet", "bridge", "agents", "tui", "tests", "README.md")
PYTEST_ARGS = ["-m", "not slow", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly"]


def settings(path: str, tests: list[str]) -> str:
    """[tool.mutmut] for one module: only that file mutated, only its tests run."""
    def arr(xs):
        return "[" + ", ".join(json.dumps(x) for x in xs) + "]"
    return (f"\n[tool.mutmut]\nsource_paths = {arr([path.split('/')[0]])}\n"
            f"only_mutate = {arr([path])}\n"
            f"pytest_add_cli_args = {arr(PYTEST_ARGS)}\n"
            f"pytest_add_cli_args_test_selection = {arr(tests)}\n"
            # a server that has imported and collected the tests forks each mutant's run (no
            # MLX computation before the fork); generous timeouts: the box is shared
            "process_isolation = \"forkserver\"\nforkserver_warmup = \"collect\"\n"
            "use_git_change_detection = false\ntimeout_multiplier = 10.0\n"
            "timeout_constant = 30.0\n")


def patterns(name: str) -> list[str]:
    """mutmut's names of the mutants of the entry's functions (none: every mutant)."""
    path, _, *functions = MODULES[name]
    module = path[:-3].replace("/", ".")
    return [f"{module}." + ("x\u01c1" + f.replace(".", "\u01c1") if "." in f else "x_" + f)
            + "__mutmut_*" for f in (functions[0] if functions else [])]


def selected(mutant: str, pats: list[str]) -> bool:
    return not pats or any(fnmatch.fnmatchcase(mutant, p) for p in pats)


def prepare(name: str) -> Path:
    path, tests = MODULES[name][:2]
    d = WORK / name
    d.mkdir(parents=True, exist_ok=True)
    for item in LINKED:
        link = d / item
        if not link.exists():
            link.symlink_to(ROOT / item)
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r"\n\[tool\.mutmut\][^\[]*", "\n", text)
    (d / "pyproject.toml").write_text(text + settings(path, tests))
    return d


def mutmut(d: Path, *args: str, check: bool = True) -> str:
    exe = Path(sys.executable).with_name("mutmut")
    env = dict(os.environ)
    for lib in ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
                "/usr/lib/aarch64-linux-gnu/libopenblas.so.0"):
        if os.path.exists(lib):
            env.setdefault("LD_PRELOAD", lib)
    out = subprocess.run([str(exe), *args], cwd=d, env=env, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise SystemExit(f"mutmut {' '.join(args)} failed in {d}:\n{out.stdout[-3000:]}"
                         f"\n{out.stderr[-3000:]}")
    return out.stdout


DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
out = {}
for name in json.load(sys.stdin):
    try:
        out[name] = get_diff_for_mutant(name, path=find_mutant(name).path)
    except Exception as e:  # a mutant whose source changed since the run
        out[name] = f"(no diff: {e})"
print(json.dumps(out))
"""


def survivors(d: Path) -> list[dict]:
    """Every mutant that was run and not killed: (id, status, diff). Mutants not run yet
    (a stopped run) are only counted."""
    rows = []
    pats = patterns(d.name)
    for line in mutmut(d, "results", "--all", "true").splitlines():
        m = re.match(r"\s*([\w.\u01c1]+__mutmut_\d+): (.+)$", line)
        if m and m.group(2).strip() not in ("killed", "not checked") and selected(m.group(1), pats):
            rows.append({"id": m.group(1), "status": m.group(2).strip()})
    if rows:  # one process for all the diffs (a `mutmut show` each takes seconds)
        out = subprocess.run([sys.executable, "-c", DIFFS], cwd=d, capture_output=True,
                             text=True, input=json.dumps([r["id"] for r in rows]))
        diffs = json.loads(out.stdout) if out.returncode == 0 else {}
        for r in rows:
            r["diff"] = diffs.get(r["id"], out.stderr[-300:]).strip()
    return rows


def run(name: str, fresh: bool, export_only: bool = False) -> dict:
    d = prepare(name)
    t0 = time.monotonic()
    if fresh and (d / "mutants").exists():  # else mutmut resumes (and re-runs what changed)
        shutil.rmtree(d / "mutants")
    if not export_only:
        mutmut(d, "run", "--max-children", os.environ.get("MUTATION_JOBS", "1"), *patterns(name),
               check=False)
    counts: dict[str, int] = {}
    for line in mutmut(d, "results", "--all", "true").splitlines():
        m = re.match(r"\s*([\w.\u01c1]+__mutmut_\d+): (.+)$", line)
        if m and selected(m.group(1), patterns(name)):
            counts[m.group(2).strip()] = counts.get(m.group(2).strip(), 0) + 1
    out = {"module": MODULES[name][0], "tests": MODULES[name][1],
           "functions": MODULES[name][2] if len(MODULES[name]) > 2 else "all", "counts": counts,
           "minutes": round((time.monotonic() - t0) / 60, 1), "survivors": survivors(d)}
    (WORK / f"{name}.json").write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str]) -> int:
    fresh, export_only = "--fresh" in argv, "--export" in argv
    names = [a for a in argv if a not in ("--fresh", "--export")] or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; known: {', '.join(MODULES)}", file=sys.stderr)
        return 2
    for name in names:
        r = run(name, fresh and not export_only, export_only)
        print(f"{name}: {r['counts']} in {r['minutes']} min; "
              f"{len(r['survivors'])} not killed -> .mutation/{name}.json", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
