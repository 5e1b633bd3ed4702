"""A training resumed from a checkpoint already at max_steps (the last one a killed run's ranks wrote before they
were ended) trains no further step: it goes straight on to the final evaluation and writes the model. Resumed with
another --learning-rate, it keeps its checkpoint's schedule, says so, and records the rate it kept."""

import json
import shutil
from pathlib import Path

import pytest
from helpers.launch import textsql_train

from bench.tiny_run import tiny_run_argv
from textsql.arguments import train_argv
from textsql.rundir.checkpoints import newest_complete_checkpoint

pytestmark = pytest.mark.slow


def test_a_checkpoint_at_max_steps_goes_straight_to_the_evaluation_and_the_model(
    prepared_sample: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = tiny_run_argv(
        prepared_sample, out, max_steps=2, eval_every=None, profile="zero0", save_steps=2, max_eval_samples=4
    )
    textsql_train(argv)
    # What a kill right after the last checkpoint leaves: no model, no run.json.
    shutil.rmtree(out / "model")
    (out / "run.json").unlink()
    assert Path(str(newest_complete_checkpoint(out))).name == "checkpoint-2"

    output = textsql_train([*argv, *train_argv(resume_from_checkpoint="auto", learning_rate=5e-4)])
    assert "resumed at step 2 of 2: nothing left to train" in output
    summary = json.loads((out / "run.json").read_text())
    assert "the checkpoint's schedule keeps its peak learning rate 0.001, not this command line's 0.0005" in output
    recipe = summary["recipe"]
    assert (recipe["peak_learning_rate"], recipe["asked_learning_rate"], recipe["kept_from_checkpoint"]) == (
        1e-3,
        5e-4,
        True,
    ), recipe
    assert summary["global_step"] == 2 and Path(summary["resumed_from"]).name == "checkpoint-2"
    assert [entry["step"] for entry in summary["log_history"] if "loss" in entry] == [1, 2], "no step 3/2"
    assert any("eval_loss" in entry for entry in summary["log_history"]), "the final evaluation ran"
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "config.json").is_file()
