"""A run that goes on with fewer workers: three `local` pods, min_workers 2, replacements impossible.

Each test is one supervised run of the embedded small T5 (one rank per pod, 6 steps, a checkpoint every
2, every step logged, no evaluation) in which the whole pod of rank 1 is killed once checkpoint-2 is
complete and step 3 is logged (deterministic: no sleep). The backend has no capacity for a replacement
(``replacements=False``), so the supervisor drops the worker, converts checkpoint-2 for two ranks and
relaunches on the two pods left, with the global batch of 12 questions kept as 2 ranks x 3 x 2 steps of
accumulation instead of 3 ranks x 4.

The reference for "the loss an uninterrupted three-worker run logs at step 3" is the killed launch
itself: up to the kill it is that run (same seed, data, world), so its step 3 is compared with the step 3
the two workers compute from the converted checkpoint. They differ by what a different split of the same
12 questions changes: T5 averages its loss over each micro-batch's tokens (the weights of the questions
in the mean move a little), and a model with dropout draws other masks (the small T5 has none since issue 28;
the figures were measured with rate 0.1). Measured: see ``LOSS_TOLERANCE``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from helpers.launch import tagged_processes

from bench.events import scalars_per_file
from bench.profiles import train_only
from bench.recovery import StepStream, kill_after, kill_pod, supervised_arguments
from bench.tiny_run import tiny_run_argv
from textsql.constants import DEFAULT_MODEL_DIR, RUN_SUMMARY_NAME
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.failures import FailureKind
from textsql.launching.launch import launch
from textsql.launching.recovery import SUPERVISOR_FILE
from textsql.launching.supervisor import supervise
from textsql.rundir.checkpoints import is_complete_checkpoint
from textsql.rundir.universal import STAGING_DIR, UNIVERSAL_LATEST_FILE, convert, converted, needs_conversion
from textsql.training.events import TENSORBOARD_SUBDIR
from worker.cluster import start_workers
from worker.network import free_port

pytestmark = pytest.mark.slow

MAX_STEPS, SAVE_STEPS, BATCH, SEED = 6, 2, 4, 7
# 72 questions: six steps of 12 a epoch, so the run stays in its first epoch, whose order is the seed's.
QUESTIONS = 72
# Relative: the same 12 questions split 3 x 4 or 2 x 2 x 3 (and, measured with dropout 0.1, other masks).
# Measured 0.0019 with ZeRO-1 and ZeRO-3 (9.4830 against 9.4649); five times that.
LOSS_TOLERANCE = 0.01


@pytest.fixture(scope="module")
def train_data(tmp_path_factory) -> Path:
    """The shipped sample's train split alone (72 questions), so the runs spend no time evaluating."""
    from textsql.data.prepare import PrepareArguments, prepare

    work = tmp_path_factory.mktemp("shrink")
    prepare(PrepareArguments(data_dir=str(work / "data"), limit=QUESTIONS, max_source_length=96))
    return train_only(str(work / "data"), work)


@pytest.fixture
def three_pods_without_replacements(tmp_path: Path):
    """Three `local` pods (127.0.0.2-4) on a backend that has no capacity for a replacement."""
    with start_workers("local", 3, tmp_path / "run", timeout=120, replacements=False) as cluster:
        yield cluster


@pytest.mark.parametrize("profile", ["zero1", "zero3"])
def test_a_lost_pod_without_replacement_leaves_two_workers_that_finish_the_run(
    three_pods_without_replacements, train_data, tmp_path, profile
):
    cluster, output, tag, killed = three_pods_without_replacements, tmp_path / "out", uuid.uuid4().hex, {}
    stream = StepStream(tmp_path / "output.log")
    killer = kill_after(stream, SAVE_STEPS + 1, output / f"checkpoint-{SAVE_STEPS}", tag, killed, kill=kill_pod)
    arguments = supervised_arguments(
        train_data,
        output,
        tag,
        profile=profile,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=BATCH,
        seed=SEED,
        # Over the batch's tokens the loss would depend on how the batch splits across ranks; over the whole
        # vocabulary three and two workers compute the same step's loss.
        loss_vocabulary="full",
        # Decaying, so a schedule restarted from its start shows in the rate (a constant one reads the same).
        lr_scheduler_type="linear",
    )
    try:
        code = supervise(arguments, cluster, max_restarts=2, stream=stream, min_workers=2, replace_timeout=30)
    finally:
        stream.close()
        print(stream.text[-8000:])
    killer.join(timeout=5)
    assert "at" in killed, killed
    record = json.loads((output / SUPERVISOR_FILE).read_text())
    print(json.dumps(record, indent=1))
    assert code == 0
    assert tagged_processes(tag) == [], "ranks left behind"

    events = record["events"]
    assert [event["event"] for event in events] == [
        FailureKind.WORKER_LOST,
        "shrunk",
        "relaunch",
        "resumed",
        "finished",
    ]
    shrunk, resumed = events[1], events[3]
    assert (shrunk["host"], shrunk["world_size_before"], shrunk["world_size_after"]) == ("127.0.0.3", 3, 2)
    assert shrunk["line"].startswith("worker 127.0.0.3 lost, no replacement after ")
    assert f"; going on with 2 workers from checkpoint-{SAVE_STEPS} (converted in " in shrunk["line"]
    assert shrunk["line"] in stream.text, "the user did not see the shrink's line"
    assert resumed["world_size"] == 2 and resumed["step"] == SAVE_STEPS + 1
    assert (cluster.run_dir / "hostfile").read_text() == "127.0.0.2 slots=1\n127.0.0.4 slots=1\n"

    summary = json.loads((output / RUN_SUMMARY_NAME).read_text())
    assert summary["global_step"] == MAX_STEPS and summary["world_size"] == 2, "not the uninterrupted run's last step"
    assert Path(summary["resumed_from"]).name == f"checkpoint-{SAVE_STEPS}"
    assert [event["event"] for event in summary["recovery"]["events"]] == [event["event"] for event in events]
    assert summary["recovery"]["world_size_first"] == 3 and summary["recovery"]["min_workers"] == 2
    assert [entry["step"] for entry in summary["log_history"] if "loss" in entry] == list(range(1, MAX_STEPS + 1))

    # One curve: the killed launch's event file up to the kill, the two workers' from the checkpoint on.
    three, two = scalars_per_file(output / TENSORBOARD_SUBDIR)
    step = SAVE_STEPS + 1
    assert min(two) == step and max(two) == MAX_STEPS and step in three, (three, two)
    difference = abs(two[step] - three[step]) / three[step]
    # The learning-rate schedule continues: the same rate at the same step.
    three_lr, two_lr = scalars_per_file(output / TENSORBOARD_SUBDIR, "train/learning_rate")
    assert two_lr[step] == three_lr[step]
    print(
        f"{profile}: step {step} loss on three workers {three[step]:.4f}, on two from the converted checkpoint "
        f"{two[step]:.4f} (relative difference {difference:.4f}); {shrunk['line']}"
    )
    assert difference <= LOSS_TOLERANCE, (three[step], two[step])


def test_a_conversion_killed_half_way_leaves_the_checkpoint_to_resume_from(train_data, tmp_path):
    """The conversion is stopped once it has begun writing, checked to be unfinished, then SIGKILLed."""
    output = tmp_path / "out"
    checkpoint = output / f"checkpoint-{SAVE_STEPS}"
    assert local_run(tmp_path, train_data, output, ranks=3, max_steps=SAVE_STEPS) == 0
    assert needs_conversion(checkpoint, 2)
    before = sorted(path.relative_to(checkpoint) for path in checkpoint.rglob("*"))

    caught: dict = {}
    stopper = threading.Thread(target=kill_conversion_half_way, args=(checkpoint, caught), daemon=True)
    stopper.start()
    with pytest.raises(
        LaunchError, match=rf"checkpoint-{SAVE_STEPS} is unchanged: resume with the ranks that wrote it"
    ):
        convert(checkpoint)
    stopper.join(timeout=5)
    assert caught.get("killed"), caught

    # SIGKILL is delivered asynchronously: a worker may still be on the way out for a moment after convert() returns.
    deadline = time.monotonic() + 10
    while conversion_processes(checkpoint) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert conversion_processes(checkpoint) == [], "the killed conversion's worker processes are still there"
    assert is_complete_checkpoint(checkpoint) and converted(checkpoint) is None
    assert not (checkpoint / UNIVERSAL_LATEST_FILE).exists()
    left = sorted(path.relative_to(checkpoint) for path in checkpoint.rglob("*"))
    assert [path for path in left if path.parts[0] != STAGING_DIR] == before, "the original checkpoint changed"
    # The three ranks that wrote it go on from it as if nothing had happened.
    assert (
        local_run(tmp_path, train_data, output, ranks=3, max_steps=SAVE_STEPS + 1, resume_from_checkpoint="auto") == 0
    )
    summary = json.loads((output / RUN_SUMMARY_NAME).read_text())
    assert Path(summary["resumed_from"]).name == checkpoint.name and summary["global_step"] == SAVE_STEPS + 1


def local_run(tmp_path: Path, data: Path, output: Path, ranks: int, max_steps: int, **values) -> int:
    """A short training run of ``ranks`` local ranks (no pods: what is tested here is the checkpoint)."""
    args = tiny_run_argv(
        data,
        output,
        max_steps=max_steps,
        eval_every=None,
        model=DEFAULT_MODEL_DIR,
        profile="zero1",
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=BATCH,
        seed=SEED,
        **values,
    )
    arguments = LaunchArguments(run_dir=output, launcher="local", ranks=ranks, train_args=args, master_port=free_port())
    return launch(arguments)


def conversion_processes(checkpoint: Path) -> list[psutil.Process]:
    """Processes of a conversion of ``checkpoint``, found by its path on their command line."""
    found = []
    for process in psutil.process_iter():
        try:
            if str(checkpoint) in process.cmdline() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found


def kill_conversion_half_way(checkpoint: Path, caught: dict) -> None:
    """SIGSTOP the conversion process once its staging directory exists, check it has not finished, SIGKILL it."""
    try:
        deadline = time.monotonic() + 300
        while not (checkpoint / STAGING_DIR).exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the conversion never started writing")
            time.sleep(0.005)
        # The conversion's own process (its pool of workers, forked from it, are its children).
        child = next(p for p in psutil.Process().children() if "textsql.rundir.universal" in p.cmdline())
        os.kill(child.pid, signal.SIGSTOP)
        if (checkpoint / UNIVERSAL_LATEST_FILE).exists():
            raise RuntimeError("the conversion had finished before it was stopped")
        os.kill(child.pid, signal.SIGKILL)
        caught["killed"] = True
    except (OSError, RuntimeError, StopIteration, psutil.Error) as error:  # reported by the test, in the main thread
        caught["error"] = repr(error)
