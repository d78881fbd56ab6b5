"""The old `macfleet.engine.drafter.*` import paths (issue 34 split the package): a user's
script that loads a trained head through them keeps working, with a warning naming the new
path, and the aliases never make the engine import the training package."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import macfleet.engine.drafter as old

# every module the package held before the split
OLD_MODULES = {"batchgen", "budget", "chat_prompts", "choice", "contamination",
               "contamination_sources", "data", "dataset", "distill", "f3codec", "features",
               "head", "prompts", "proposer", "self_instruct", "train", "tree_draft"}
# a name a script may hold, per old module, and where it lives now
SAMPLES = {
    "head": ("load_head", "macfleet.engine.proposers.eagle.head"),
    "features": ("extract_features", "macfleet.engine.proposers.eagle.features"),
    "proposer": ("EagleProposer", "macfleet.engine.proposers.eagle.chain"),
    "tree_draft": ("EagleTreeProposer", "macfleet.engine.proposers.eagle.tree"),
    "f3codec": ("encode_int8", "macfleet.engine.proposers.eagle.f3codec"),
    "choice": ("resolve_proposer", "macfleet.engine.proposers.choice"),
    "budget": ("VerifyCurve", "macfleet.engine.tree_budget"),
    "distill": ("distill_from_dataset", "macfleet.distill.pipeline"),
    "batchgen": ("generate_samples", "macfleet.distill.batchgen"),
    "chat_prompts": ("chat_prompts", "macfleet.distill.chat_prompts"),
    "contamination": ("PromptIndex", "macfleet.distill.contamination"),
    "contamination_sources": ("template_prompts", "macfleet.distill.contamination_sources"),
    "data": ("read_texts", "macfleet.distill.data"),
    "dataset": ("generate_dataset", "macfleet.distill.dataset"),
    "prompts": ("HELD_OUT", "macfleet.distill.prompts"),
    "self_instruct": ("generate_questions", "macfleet.distill.self_instruct"),
    "train": ("TrainParams", "macfleet.distill.train"),
}


def test_every_old_module_has_a_new_home():
    assert set(old.MOVED) == OLD_MODULES == set(SAMPLES)
    for homes in old.MOVED.values():
        for home in homes:
            importlib.import_module(home)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_an_old_path_gives_the_new_object_and_names_its_new_home(name):
    attr, home = SAMPLES[name]
    sys.modules.pop(f"macfleet.engine.drafter.{name}", None)
    with pytest.warns(DeprecationWarning, match=home.replace(".", r"\.")):
        alias = importlib.import_module(f"macfleet.engine.drafter.{name}")
    assert getattr(alias, attr) is getattr(importlib.import_module(home), attr)
    assert attr in dir(alias)


def test_names_that_moved_to_another_module_still_resolve():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from macfleet.engine.drafter.distill import read_eval
        from macfleet.engine.drafter.proposer import default_head_path, shared_head
        from macfleet.engine.drafter.self_instruct import question_prompts
        from macfleet.engine.drafter.train import _step_losses  # private names too
    from macfleet.distill.train import _step_losses as new_step_losses
    from macfleet.engine.proposers.eagle.head import read_eval as new_read_eval
    assert read_eval is new_read_eval and _step_losses is new_step_losses
    assert default_head_path("smollm2").name == "smollm2-eagle.safetensors"
    assert callable(shared_head)
    from macfleet.distill.prompts import question_prompts as new_question_prompts
    assert question_prompts is new_question_prompts


def test_a_head_saved_now_loads_through_the_old_path(tiny, tmp_path):
    from macfleet.engine.proposers.eagle.head import EagleConfig, EagleHead

    head = EagleHead(EagleConfig.for_verifier(tiny.model, tiny.spec), tiny.model)
    head.save(tmp_path / "head")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from macfleet.engine.drafter.head import load_head
    loaded = load_head(tmp_path / "head", tiny.model)
    assert loaded.config == head.config


def test_an_unknown_old_module_fails_naming_the_new_places():
    with pytest.raises(ModuleNotFoundError, match="macfleet.engine.proposers.eagle.*"
                                                  "macfleet.distill"):
        importlib.import_module("macfleet.engine.drafter.no_such_module")
    with pytest.raises(AttributeError):
        old.no_such_module  # noqa: B018


def test_the_aliases_load_nothing_until_asked():
    code = ("import sys, macfleet.engine, macfleet.engine.drafter\n"
            "print(sorted(m for m in sys.modules if m.startswith(('macfleet.distill', "
            "'macfleet.engine.proposers.eagle', 'macfleet.engine.drafter.'))))\n"
            "from macfleet.engine.drafter.head import load_head\n"
            "print(sorted(m for m in sys.modules if m.startswith('macfleet.distill')))\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]
