"""Continuing a pipeline of notebooks (`demo --resume`, the AMP's jobs): what pipeline.json records, what a
continuation skips or relaunches. A real demo killed and continued: test_demo_continuation.py. What a continued
training is pinned to: test_pipeline_pins.py. What a hard kill leaves behind and how it is ended:
test_pipeline_leftovers.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.checkpoints import complete_checkpoint
from helpers.pipeline_records import actions, finished_demo, record

from textsql.cli import cli
from textsql.pipeline.demo import DEMO_MARKER, demo_parameters
from textsql.pipeline.manifest import (
    INFER,
    MANIFEST_NAME,
    PREPARE,
    TRAIN,
    Manifest,
    continuation_steps,
    effective_parameters,
    manifest_path,
)
from textsql.pipeline.parameters import job_parameters
from textsql.rundir.master_state import master_dir


def test_a_completed_chain_is_skipped_whole_and_a_control_parameter_changes_nothing(tmp_path):
    manifest, chosen = finished_demo(tmp_path)
    assert actions(continuation_steps(manifest, chosen)) == ["skip", "skip", "skip"]
    chosen[PREPARE]["log_level"] = chosen[TRAIN]["max_restarts"] = "info"
    assert actions(continuation_steps(manifest, chosen)) == ["skip", "skip", "skip"], (
        "log level and restarts do not change results"
    )


def test_a_changed_parameter_reruns_its_notebook_and_every_one_after_it(tmp_path):
    manifest, chosen = finished_demo(tmp_path)
    changed = {**chosen, INFER: {**chosen[INFER], "limit": 4}}
    steps = continuation_steps(manifest, changed)
    assert actions(steps) == ["skip", "skip", "run"]
    assert steps[INFER].reason == "changed limit None -> 4"
    changed = {**chosen, PREPARE: {**chosen[PREPARE], "limit": 48}}
    steps = continuation_steps(manifest, changed)
    assert actions(steps) == ["run", "run", "run"]
    assert steps[PREPARE].extra == {"overwrite": True}, "notebook 01 replaces its earlier dataset"
    assert steps[TRAIN].extra == {"resume_from_checkpoint": None, "overwrite_output_dir": True}, (
        "trained again from step 0"
    )
    assert steps[TRAIN].reason == f"{PREPARE} runs again"


def test_a_missing_output_reruns_its_notebook(tmp_path):
    manifest, chosen = finished_demo(tmp_path)
    (tmp_path / "metrics.json").unlink()
    steps = continuation_steps(manifest, chosen)
    assert actions(steps) == ["skip", "skip", "run"]
    assert steps[INFER].reason == f"its output {tmp_path / 'metrics.json'} is gone"


def test_a_training_killed_after_a_checkpoint_is_relaunched_to_resume_from_it(tmp_path):
    chosen = demo_parameters(tmp_path)
    manifest = Manifest(tmp_path)
    record(manifest, chosen, PREPARE)
    manifest.started(TRAIN, effective_parameters(TRAIN, chosen[TRAIN]), tmp_path / "02.ipynb")  # then a hard kill
    complete_checkpoint(tmp_path, 2)
    (tmp_path / "checkpoint-4").mkdir()  # cut off while saving
    steps = continuation_steps(
        Manifest.load(tmp_path), {**chosen, TRAIN: {**chosen[TRAIN], "max_steps": 8, "workers": 1}}
    )
    assert actions(steps) == ["skip", "relaunch", "run"]
    assert steps[TRAIN].extra == {"resume_from_checkpoint": "auto", "overwrite_output_dir": False}
    assert steps[TRAIN].reason.endswith(": resuming from checkpoint-2")


def test_a_killed_training_without_a_complete_checkpoint_starts_over_as_the_same_training(tmp_path):
    """From step 0, but relaunched as the supervisor relaunches it: resuming, so it logs on into the same MLflow run
    (textsql.tracking.launch_runs); changed, or on a dataset prepared again, it is another training."""
    chosen = demo_parameters(tmp_path)
    manifest = Manifest(tmp_path)
    record(manifest, chosen, PREPARE)
    record(manifest, chosen, TRAIN, completed=False)
    (tmp_path / "checkpoint-2").mkdir()
    steps = continuation_steps(manifest, chosen)
    assert actions(steps) == ["skip", "relaunch", "run"]
    assert steps[TRAIN].extra == {"resume_from_checkpoint": "auto", "overwrite_output_dir": False}
    assert steps[TRAIN].reason.endswith(": no complete checkpoint here, starting again from step 0")
    changed = {**chosen, TRAIN: {**chosen[TRAIN], "max_steps": 8}}
    assert continuation_steps(manifest, changed)[TRAIN].extra == {
        "resume_from_checkpoint": None,
        "overwrite_output_dir": True,
    }
    prepared_again = {**chosen, PREPARE: {**chosen[PREPARE], "limit": 48}}
    assert continuation_steps(manifest, prepared_again)[TRAIN].extra["overwrite_output_dir"] is True


def test_a_continuation_whose_run_directory_is_lost_resumes_from_its_checkpoint_store_instead_of_deleting_it(tmp_path):
    """A new pod, volume or project: no record and no checkpoint here, the store holds the training. A fresh run
    (overwrite_output_dir) would delete the store's checkpoints; the continuation resumes from them instead."""
    stored = demo_parameters(tmp_path)
    stored[TRAIN]["checkpoint_store"] = "s3://bucket/runs/demo"
    steps = continuation_steps(Manifest.load(tmp_path), stored)
    assert actions(steps) == ["run", "relaunch", "run"]
    assert steps[TRAIN].extra == {"resume_from_checkpoint": "auto", "overwrite_output_dir": False}
    assert steps[TRAIN].reason == (
        "no record of an earlier run: resuming from the newest complete checkpoint in its checkpoint store, else from step 0"
    )
    assert "s3://" not in steps[TRAIN].reason, "a store URI is the user's to show, not the plan's"
    # Asked to start over, or without a store, the training runs fresh as before.
    replaced = {**stored, TRAIN: {**stored[TRAIN], "overwrite_output_dir": True}}
    assert actions(continuation_steps(Manifest.load(tmp_path), replaced)) == ["run", "run", "run"]
    assert actions(continuation_steps(Manifest.load(tmp_path), demo_parameters(tmp_path))) == ["run", "run", "run"]
    # A killed training whose checkpoints only the store kept is said to resume from there, not from step 0.
    manifest = Manifest(tmp_path)
    record(manifest, stored, PREPARE)
    record(manifest, stored, TRAIN, completed=False)
    assert continuation_steps(manifest, stored)[TRAIN].reason.endswith(
        "no complete checkpoint here, resuming from the newest complete checkpoint in its checkpoint store, else from step 0"
    )


def test_a_job_whose_earlier_notebook_ran_again_runs_again(tmp_path):
    # The job chain: 01, 02 and 03 completed, then the 01 job alone ran again with other parameters.
    manifest, chosen = finished_demo(tmp_path)
    chosen[PREPARE]["limit"] = 48
    record(manifest, chosen, PREPARE)
    steps = continuation_steps(Manifest.load(tmp_path), chosen)
    assert actions(steps) == ["skip", "run", "run"]
    assert steps[TRAIN].reason == f"{PREPARE} ran again since"


def test_the_manifest_is_whole_whenever_its_writer_is_killed(tmp_path):
    writer = (
        "import sys\n"
        "from textsql.pipeline.manifest import Manifest\n"
        "manifest = Manifest(sys.argv[1])\n"
        "manifest.data['filler'] = ['x' * 1000] * 200\n"
        "n = 0\n"
        "while True:\n"
        "    n += 1\n"
        "    manifest.data['n'] = n\n"
        "    manifest.save()\n"
    )
    seen = set()
    for delay in (0.6, 0.75, 0.9, 1.1, 1.3):
        process = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path)])
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        if manifest_path(tmp_path).exists():
            seen.add(json.loads(manifest_path(tmp_path).read_text())["n"])
    assert seen, "the writer never wrote"
    leftovers = [path.name for path in master_dir(tmp_path).iterdir() if path.name != MANIFEST_NAME]
    assert all(name.startswith(f".{MANIFEST_NAME}.") for name in leftovers), leftovers


def test_continuing_a_demo_refuses_a_change_under_a_checkpoint_in_one_line_before_any_notebook(tmp_path):
    out = tmp_path / "demo"
    chosen = demo_parameters(out)
    manifest = Manifest(out)
    record(manifest, chosen, PREPARE)
    record(manifest, chosen, TRAIN, completed=False)
    complete_checkpoint(out, 2)
    (out / DEMO_MARKER).touch()
    before = manifest_path(out).read_text()
    result = CliRunner().invoke(cli, ["demo", "--run-dir", str(out), "--resume", "-p", "learning_rate=0.01"])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("Error: cannot resume 02_train_distributed from checkpoint-2")
    assert manifest_path(out).read_text() == before, "nothing ran"


JOB = Path(__file__).resolve().parent.parent / "cml" / "run_notebook.py"


def job(name: str, env: dict, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(JOB), name, *arguments],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_a_continued_job_skips_its_completed_notebook_and_names_the_job_to_run_first(tmp_path):
    env = {"TEXTSQL_RUN_DIR": str(tmp_path / "run"), "TEXTSQL_DATA_DIR": str(tmp_path / "data")}
    refused = job(INFER, env, "--resume")
    assert refused.returncode == 1 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"Error: {PREPARE} must run first (no record of an earlier run); start its job, then this one"
    ]
    chosen = job_parameters(environ={**os.environ, **env})
    manifest = Manifest(tmp_path / "run")
    record(manifest, chosen, PREPARE)
    skipped = job(PREPARE, {**env, "TEXTSQL_RESUME_FROM_CHECKPOINT": "auto"})
    assert skipped.returncode == 0, skipped.stderr
    assert skipped.stdout.strip() == f"{PREPARE} skipped: completed with the same parameters; its outputs are in place"
    assert Manifest.load(tmp_path / "run").records == manifest.records, "nothing ran, nothing was recorded"


def test_a_pipeline_record_a_worker_forges_in_the_run_directory_skips_nothing(tmp_path):
    """pipeline.json in the run directory (where it once lived, and a worker can write) is not the record."""
    out = tmp_path / "demo"
    chosen = demo_parameters(out)
    forged = Manifest(out)
    record(forged, chosen, PREPARE)
    record(forged, chosen, TRAIN)
    record(forged, chosen, INFER)
    (out / MANIFEST_NAME).write_text(manifest_path(out).read_text())
    shutil.rmtree(master_dir(out))
    assert {step.action for step in continuation_steps(Manifest.load(out), chosen).values()} == {"run"}


def test_an_executed_notebook_is_never_written_into_a_linked_notebooks_directory(tmp_path):
    """`textsql demo --resume` had papermill replace another project's notebook: a worker linked
    RUN_DIR/notebooks to that project's notebooks directory. Papermill's writes (the demo's handler) refuse it."""
    import nbformat
    from papermill.iorw import write_ipynb

    from textsql.pipeline.runs import write_notebooks_without_following_links
    from worker.files import UnsafePath

    elsewhere = tmp_path / "other-project" / "notebooks"
    elsewhere.mkdir(parents=True)
    (elsewhere / "03_inference.ipynb").write_text("the other project's notebook")
    run = tmp_path / "run"
    run.mkdir()
    (run / "notebooks").symlink_to(elsewhere)
    write_notebooks_without_following_links()
    with pytest.raises(UnsafePath, match="notebooks: it is a symbolic link"):
        write_ipynb(nbformat.v4.new_notebook(), str(run / "notebooks" / "03_inference.ipynb"))
    assert [path.name for path in elsewhere.iterdir()] == ["03_inference.ipynb"]
    assert (elsewhere / "03_inference.ipynb").read_text() == "the other project's notebook"
