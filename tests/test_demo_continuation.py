"""One small demo continued every way a user continues it, as one scenario run once for the module (the
``scenario`` fixture), in four steps:

1. killed hard: a demo with a ``file://`` checkpoint store is SIGKILLed once its first complete checkpoint is
   written, with notebook 02 still running;
2. continued: ``demo --resume`` skips notebook 01, ends what the kill left running, resumes training from the
   checkpoint to ``max_steps``, uploads to the store and runs notebook 03;
3. inference alone: ``demo --resume -p 03_inference.limit=4`` runs notebook 03 again, and nothing else;
4. on a new machine: the run directory, its dataset and its master-private directory deleted, ``demo --resume``
   with more steps resumes training from the store's newest checkpoint.

The fixture records what each step left (its terminal, pipeline.json, run.json, mtimes, the processes still
running) when the step ends, and checks the step ended as it must; each test reads one step's record. A step that
did not end as it must fails the tests of that step and of every later one, with one message naming it.
What a continuation plans, without a demo: test_pipeline_continuation.py; the store itself: test_store_runs.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from textsql.constants import LAUNCH_LOG_NAME, RUN_SUMMARY_NAME
from textsql.launching.ranks import marked_processes
from textsql.pipeline.demo import demo_data_dir
from textsql.pipeline.leftovers import end_leftovers, launch_ids
from textsql.pipeline.manifest import ATTEMPT_VAR, INFER, PREPARE, TRAIN, manifest_path
from textsql.pipeline.parameters import NOTEBOOKS
from textsql.rank_lines import RUN_MARK_VAR
from textsql.rundir.checkpoints import COMPLETE_MARKER, checkpoint_dirs, is_complete_checkpoint
from textsql.rundir.master_state import master_dir

pytestmark = pytest.mark.slow

TEXTSQL = str(Path(sys.executable).parent / "textsql")
DEMO_S = 1200
MAX_STEPS = 20
# The new machine's training: two steps past the first one's, so one more checkpoint.
MORE_STEPS = MAX_STEPS + 2
SMALL_DEMO = [
    "-p",
    "01_prepare_dataset.limit=48",
    "-p",
    "eval_steps=4",
    "-p",
    "per_device_train_batch_size=4",
    "-p",
    "03_inference.limit=6",
]

KILLED = "step 1, the demo killed hard after a checkpoint"
CONTINUED = "step 2, the killed demo continued (--resume)"
INFERENCE_ONLY = "step 3, inference alone continued (--resume -p 03_inference.limit=4)"
NEW_MACHINE = "step 4, the demo continued on a new machine from its store (--resume)"


class StepFailed(Exception):
    """A step of the scenario did not end as it must; the message names the step and says how it ended."""


@dataclass
class Killed:
    manifest: dict[str, Any]  # pipeline.json just after the kill
    left_running: list[int]  # the killed attempt's processes still running then
    launches: list[str]  # its launches on record in the master-private directory
    prepared_ns: int  # the mtime of the dataset's prepare.json


@dataclass
class Continued:
    ran: subprocess.CompletedProcess[str]
    manifest: dict[str, Any]
    prepared_ns: int
    run: dict[str, Any]  # run.json
    launch_log: str
    metrics: dict[str, Any]
    attempt_left: list[int]  # the killed attempt's processes still running after the continuation
    ranks_left: list[int]  # and the ranks of its launches
    trained_ns: int  # the mtime of run.json


@dataclass
class InferenceOnly:
    ran: subprocess.CompletedProcess[str]
    trained_ns: int
    metrics: dict[str, Any]


@dataclass
class NewMachine:
    ran: subprocess.CompletedProcess[str]
    run: dict[str, Any]
    stored_before: dict[str, int]  # the store's checkpoints before the step, with the mtimes of their markers
    stored: dict[str, int]  # and after it


@dataclass
class Scenario:
    root: Path
    records: dict[str, Any] = field(default_factory=dict, repr=False)
    failure: tuple[str, str] | None = None  # the step that did not end as it must, and how it ended

    @property
    def run_dir(self) -> Path:
        return self.root / "demo"

    @property
    def store(self) -> Path:
        return self.root / "store"

    def after(self, step: str) -> Any:
        """What ``step`` recorded; fails the test, naming the step that went wrong, where it or one before it did."""
        if step not in self.records:
            assert self.failure is not None
            failed, how = self.failure
            pytest.fail(how if failed == step else f"{step} did not run: {how.splitlines()[0]}", pytrace=False)
        return self.records[step]

    def demo(self, step: str, *arguments: str, max_steps: int = MAX_STEPS) -> subprocess.CompletedProcess[str]:
        """``textsql demo`` of the scenario, to its end; raises StepFailed unless it exits 0."""
        try:
            ran = subprocess.run(
                [TEXTSQL, "demo", "--run-dir", str(self.run_dir), *self.parameters(max_steps), *arguments],
                check=False,
                cwd=self.root,
                env=demo_environment(),
                capture_output=True,
                text=True,
                timeout=DEMO_S,
            )
        except subprocess.TimeoutExpired as timeout:
            raise StepFailed(f"{step}: still running after {DEMO_S} s") from timeout
        if ran.returncode != 0:
            tail = (ran.stdout[-3000:] + ran.stderr[-3000:]).strip()
            raise StepFailed(f"{step}: `textsql demo` exited {ran.returncode}\n{tail}")
        return ran

    def parameters(self, max_steps: int) -> list[str]:
        return [*SMALL_DEMO, "-p", f"max_steps={max_steps}", "-p", f"checkpoint_store=file://{self.store}"]


def demo_environment() -> dict[str, str]:
    """The tests' environment without an attempt's marks (conftest's no_attempt_marker, which a module-scoped
    fixture cannot use), one thread per rank."""
    return {key: value for key, value in os.environ.items() if key not in (ATTEMPT_VAR, RUN_MARK_VAR)} | {
        "OMP_NUM_THREADS": "1"
    }


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def kill_after_a_checkpoint(scenario: Scenario) -> None:
    out = scenario.run_dir
    log_path = scenario.root / "killed.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen(
            [TEXTSQL, "demo", "--run-dir", str(out), *scenario.parameters(MAX_STEPS)],
            cwd=scenario.root,
            env=demo_environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + DEMO_S
    # Any complete checkpoint: the trainer keeps only the last two, so the first may be rotated away when looked for.
    while not any(is_complete_checkpoint(path) for path in checkpoint_dirs(out)):
        if first.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(first.pid, signal.SIGKILL)
            how = f"exited {first.returncode}" if first.returncode is not None else f"still running after {DEMO_S} s"
            raise StepFailed(f"{KILLED}: no complete checkpoint before the demo {how}\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)  # papermill and all in its group; the kernel, workers and ranks have their own
    first.wait()
    killed = read(manifest_path(out))
    scenario.records[KILLED] = Killed(
        manifest=killed,
        left_running=marked_processes(killed["attempt"]["id"], ATTEMPT_VAR),
        launches=launch_ids(out),
        prepared_ns=(demo_data_dir(out) / "prepare.json").stat().st_mtime_ns,
    )


def continue_the_killed_demo(scenario: Scenario) -> None:
    out = scenario.run_dir
    ran = scenario.demo(CONTINUED, "--resume")
    killed: Killed = scenario.records[KILLED]
    scenario.records[CONTINUED] = Continued(
        ran=ran,
        manifest=read(manifest_path(out)),
        prepared_ns=(demo_data_dir(out) / "prepare.json").stat().st_mtime_ns,
        run=read(out / RUN_SUMMARY_NAME),
        launch_log=(out / LAUNCH_LOG_NAME).read_text(),
        metrics=read(out / "metrics.json"),
        attempt_left=marked_processes(killed.manifest["attempt"]["id"], ATTEMPT_VAR),
        ranks_left=[pid for launch in killed.launches for pid in marked_processes(launch)],
        trained_ns=(out / RUN_SUMMARY_NAME).stat().st_mtime_ns,
    )


def continue_inference_alone(scenario: Scenario) -> None:
    out = scenario.run_dir
    ran = scenario.demo(INFERENCE_ONLY, "--resume", "-p", "03_inference.limit=4")
    scenario.records[INFERENCE_ONLY] = InferenceOnly(
        ran=ran, trained_ns=(out / RUN_SUMMARY_NAME).stat().st_mtime_ns, metrics=read(out / "metrics.json")
    )


def continue_on_a_new_machine(scenario: Scenario) -> None:
    out = scenario.run_dir
    stored_before = stored_checkpoints(scenario.store)
    for gone in (out, demo_data_dir(out), master_dir(out)):
        shutil.rmtree(gone)
    ran = scenario.demo(NEW_MACHINE, "--resume", max_steps=MORE_STEPS)
    scenario.records[NEW_MACHINE] = NewMachine(
        ran=ran,
        run=read(out / RUN_SUMMARY_NAME),
        stored_before=stored_before,
        stored=stored_checkpoints(scenario.store),
    )


def stored_checkpoints(store: Path) -> dict[str, int]:
    """The store's checkpoints, each with the mtime of its complete marker (0 without one)."""
    marked = {path.parent.name: path.stat().st_mtime_ns for path in store.glob(f"checkpoint-*/{COMPLETE_MARKER}")}
    return {path.name: marked.get(path.name, 0) for path in sorted(store.glob("checkpoint-*"))}


STEPS: dict[str, Callable[[Scenario], None]] = {
    KILLED: kill_after_a_checkpoint,
    CONTINUED: continue_the_killed_demo,
    INFERENCE_ONLY: continue_inference_alone,
    NEW_MACHINE: continue_on_a_new_machine,
}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Scenario:
    """The four steps in order, each one's record kept; the first that does not end as it must stops the scenario
    (what the kill left running is then ended, not left to the machine)."""
    scenario = Scenario(tmp_path_factory.mktemp("continued-demo"))
    for name, step in STEPS.items():
        try:
            step(scenario)
        except StepFailed as failed:
            scenario.failure = (name, str(failed))
        except (OSError, KeyError, ValueError):  # a file the step should have left is missing or not its JSON
            scenario.failure = (name, f"{name}: {traceback.format_exc()}")
        if scenario.failure:
            break
    yield scenario
    if scenario.failure and KILLED in scenario.records and master_dir(scenario.run_dir).is_dir():
        end_leftovers(scenario.run_dir, scenario.records[KILLED].manifest["attempt"]["id"])


def test_the_kill_leaves_the_training_running_on_record_and_its_processes_behind(scenario: Scenario) -> None:
    killed: Killed = scenario.after(KILLED)
    notebooks = killed.manifest["notebooks"]
    assert notebooks[TRAIN]["status"] == "running" and notebooks[PREPARE]["status"] == "completed"
    assert killed.left_running, "the hard kill left processes of the run behind"
    assert killed.launches, "the killed launch is on record in the run's master-private directory"


def test_the_continuation_skips_the_prepared_dataset(scenario: Scenario) -> None:
    killed: Killed = scenario.after(KILLED)
    continued: Continued = scenario.after(CONTINUED)
    assert f"{PREPARE} skipped: completed with the same parameters" in continued.ran.stderr
    assert continued.manifest["notebooks"][PREPARE] == killed.manifest["notebooks"][PREPARE], (
        "notebook 01 did not run again"
    )
    assert continued.prepared_ns == killed.prepared_ns


def test_the_continuation_resumes_training_from_the_killed_runs_checkpoint_to_max_steps(scenario: Scenario) -> None:
    continued: Continued = scenario.after(CONTINUED)
    assert f"{TRAIN} runs: it did not complete (running): resuming from checkpoint-" in continued.ran.stderr
    resumed_from = int(Path(continued.run["resumed_from"]).name.removeprefix("checkpoint-"))
    assert resumed_from >= 4 and continued.run["global_step"] == MAX_STEPS, "continued from the checkpoint to max_steps"
    assert f"--resume-from-checkpoint auto: resuming from {continued.run['resumed_from']}" in continued.launch_log


def test_the_continuation_completes_every_notebook(scenario: Scenario) -> None:
    continued: Continued = scenario.after(CONTINUED)
    assert [continued.manifest["notebooks"][name]["status"] for name in NOTEBOOKS] == ["completed"] * 3
    assert continued.metrics["n"] == 6


def test_the_continuation_ends_what_the_kill_left_running(scenario: Scenario) -> None:
    continued: Continued = scenario.after(CONTINUED)
    assert not continued.attempt_left, "the killed run's processes were ended"
    assert not continued.ranks_left, "and its ranks"


def test_the_continuation_says_on_its_terminal_that_it_uploaded_its_checkpoint_to_the_store(
    scenario: Scenario,
) -> None:
    continued: Continued = scenario.after(CONTINUED)
    said = continued.ran.stdout + continued.ran.stderr
    assert f"checkpoint store: checkpoint-{MAX_STEPS} uploaded to file://{scenario.store}" in said, (
        "the upload is a line of the demo's terminal"
    )


def test_a_changed_inference_parameter_reruns_inference_alone(scenario: Scenario) -> None:
    continued: Continued = scenario.after(CONTINUED)
    again: InferenceOnly = scenario.after(INFERENCE_ONLY)
    assert f"{PREPARE} skipped" in again.ran.stderr and f"{TRAIN} skipped" in again.ran.stderr
    assert f"{INFER} runs: changed limit 6 -> 4" in again.ran.stderr
    assert again.trained_ns == continued.trained_ns, "training did not run again"
    assert again.metrics["n"] == 4


def test_a_demo_continued_on_a_new_machine_resumes_its_training_from_the_stores_newest_checkpoint(
    scenario: Scenario,
) -> None:
    """Where the run directory and the master's records are gone (before, the continuation trained afresh and
    deleted the store's checkpoints)."""
    moved: NewMachine = scenario.after(NEW_MACHINE)
    said = moved.ran.stdout + moved.ran.stderr
    assert f"{TRAIN} runs: no record of an earlier run: resuming from the newest complete checkpoint" in said
    assert Path(moved.run["resumed_from"]).name == f"checkpoint-{MAX_STEPS}", (
        "the training went on from the store's checkpoint"
    )
    assert moved.run["global_step"] == MORE_STEPS


def test_the_store_keeps_the_checkpoint_resumed_from_and_the_new_machines(scenario: Scenario) -> None:
    moved: NewMachine = scenario.after(NEW_MACHINE)
    resumed_from = f"checkpoint-{MAX_STEPS}"
    assert sorted(moved.stored) == [resumed_from, f"checkpoint-{MORE_STEPS}"]
    # A training afresh to MORE_STEPS would leave the same two names (a checkpoint every eval_steps, the newest two
    # kept), but its own checkpoint of that step in place of the continued demo's.
    assert moved.stored[resumed_from] == moved.stored_before[resumed_from], (
        f"the store's {resumed_from} is the continued demo's, not trained again"
    )
