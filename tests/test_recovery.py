"""Recovery with real training: a rank SIGKILLed on one of two `local` worker pods, after a checkpoint
and in the middle of one, or stopped with SIGSTOP after one; the supervisor relaunches and the run
finishes by itself.

Each test is one supervised run of the embedded small T5 (zero1, one rank per pod, 6 steps, a
checkpoint every 2, every step logged, no evaluation). The kills are deterministic, never after a
sleep: after a checkpoint, once its completion marker is there and the next step is logged; during a
save, once rank 1 opens its ZeRO shard of the next checkpoint, which the test has made a named pipe
(opening it for writing blocks until the test opens it for reading, so the rank is caught mid-save).

The reference for "the loss an uninterrupted run logs at that step" is the killed launch itself: up
to the kill it *is* an uninterrupted run (same seed, data, world size), so its step after the
checkpoint is compared with the resumed launch's, without a third launch on two shared cores.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers.launch import tagged_processes

from bench.events import scalars_per_file
from bench.recovery import KILLED_RANK, StepStream, kill_after, rank_process, supervised_arguments
from textsql.constants import RUN_SUMMARY_NAME
from textsql.launching.failures import FailureKind
from textsql.launching.recovery import SUPERVISOR_FILE
from textsql.launching.supervisor import supervise
from textsql.rundir.checkpoints import COMPLETE_MARKER, SET_ASIDE_PREFIX
from textsql.training.events import TENSORBOARD_SUBDIR

pytestmark = pytest.mark.slow

MAX_STEPS, SAVE_STEPS = 6, 2
# Both runs log the loss rounded to 4 decimals (the trainer's rounding): equal runs differ by at most that.
LOSS_TOLERANCE = 2e-4
# Seconds without progress that make a stall here: the shortest allowed, so the stopped run ends soon.
STALL_TIMEOUT_S = 20.0
STOPPED_RUN_BOUND_S = 480


def run_supervised(cluster, data: Path, output: Path, tag: str, stream: StepStream, **options) -> dict:
    """The supervised run to the end (``options``: more arguments of ``supervise``); supervisor.json's events.
    No rank is left behind."""
    arguments = supervised_arguments(
        data,
        output,
        tag,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=4,
        seed=7,
        # Decaying, so a schedule restarted from its start shows in the rate (a constant one reads the same).
        lr_scheduler_type="linear",
    )
    try:
        code = supervise(arguments, cluster, max_restarts=2, stream=stream, **options)
    finally:
        stream.close()
        print(stream.text[-8000:])
    print(json.dumps(json.loads((output / SUPERVISOR_FILE).read_text()), indent=1))
    assert code == 0
    assert tagged_processes(tag) == [], "ranks left behind"
    return json.loads((output / SUPERVISOR_FILE).read_text())


def assert_resumed_to_the_end(
    output: Path, record: dict, checkpoint: str, failure: FailureKind = FailureKind.WORKER_LOST
) -> dict:
    """One ``failure`` on 127.0.0.3, relaunched and resumed from ``checkpoint`` to an uninterrupted run's last step."""
    events = record["events"]
    assert [event["event"] for event in events] == [failure, "relaunch", "resumed", "finished"]
    lost, relaunch, resumed = events[0], events[1], events[2]
    assert lost["host"] == "127.0.0.3"
    if failure is FailureKind.WORKER_LOST:
        assert "SIGKILL" in lost["message"]
        assert lost["line"].startswith(f"worker lost at step {lost['step']} (") and ", detected after " in lost["line"]
    assert Path(relaunch["checkpoint"]).name == checkpoint == Path(resumed["checkpoint"]).name
    assert 1 <= lost["step"] - int(checkpoint.split("-")[1]) <= SAVE_STEPS, "more than save_steps steps repeated"
    assert resumed["line"].startswith(f"resumed from {checkpoint}: step {int(checkpoint.split('-')[1]) + 1} done")
    summary = json.loads((output / RUN_SUMMARY_NAME).read_text())
    assert summary["global_step"] == MAX_STEPS and Path(summary["resumed_from"]).name == checkpoint
    assert [entry["step"] for entry in summary["log_history"] if "loss" in entry] == list(range(1, MAX_STEPS + 1))
    assert [event["event"] for event in summary["recovery"]["events"]] == [event["event"] for event in events]
    return summary


def test_a_rank_killed_after_a_checkpoint_resumes_from_it_with_the_uninterrupted_loss(
    two_local_workers, train_data, tmp_path
):
    output, tag, killed = tmp_path / "out", uuid.uuid4().hex, {}
    stream = StepStream(tmp_path / "output.log")
    # Step 3 is logged only after checkpoint-2's on_save (barrier, then the marker): the kill lands after it.
    killer = kill_after(stream, SAVE_STEPS + 1, output / f"checkpoint-{SAVE_STEPS}", tag, killed)
    record = run_supervised(two_local_workers, train_data, output, tag, stream)
    killer.join(timeout=5)
    assert "at" in killed, killed

    summary = assert_resumed_to_the_end(output, record, f"checkpoint-{SAVE_STEPS}")
    lost = record["events"][0]
    repeated = lost["step"] - SAVE_STEPS
    # The killed launch's own curve up to the kill, and the resumed launch's from the checkpoint on.
    first, after_resume = scalars_per_file(output / TENSORBOARD_SUBDIR)
    assert min(after_resume) == SAVE_STEPS + 1, after_resume
    resumed_losses = {entry["step"]: entry["loss"] for entry in summary["log_history"] if "loss" in entry}
    overlap = sorted(set(first) & set(after_resume))
    assert overlap and overlap[0] == SAVE_STEPS + 1
    for step in overlap:
        assert abs(resumed_losses[step] - first[step]) <= LOSS_TOLERANCE, (step, resumed_losses[step], first[step])
    # The learning-rate schedule continues where it was, not from its start.
    first_lr, resumed_lr = scalars_per_file(output / TENSORBOARD_SUBDIR, "train/learning_rate")
    assert [resumed_lr[step] for step in overlap] == [first_lr[step] for step in overlap]
    print(
        f"rank SIGKILL after checkpoint-{SAVE_STEPS}: {lost['line']}; {repeated} step(s) repeated; "
        f"losses at steps {overlap}: uninterrupted {[first[s] for s in overlap]}, resumed {[resumed_losses[s] for s in overlap]}"
    )


# Without the stall detector the stopped rank holds the run for the process-group timeout (30 minutes):
# the bound makes that a failure here.
@pytest.mark.timeout(STOPPED_RUN_BOUND_S)
def test_a_rank_stopped_after_a_checkpoint_is_a_stall_and_resumes_from_it(two_local_workers, train_data, tmp_path):
    output, tag, stopped = tmp_path / "out", uuid.uuid4().hex, {}
    stream = StepStream(tmp_path / "output.log")
    # SIGSTOP: the rank is alive and holds its sockets, so nothing fails; only the stall detector can end it.
    stopper = kill_after(stream, SAVE_STEPS + 1, output / f"checkpoint-{SAVE_STEPS}", tag, stopped, kill=stop_rank)
    record = run_supervised(two_local_workers, train_data, output, tag, stream, stall_timeout=STALL_TIMEOUT_S)
    stopper.join(timeout=5)
    assert "at" in stopped, stopped

    assert_resumed_to_the_end(output, record, f"checkpoint-{SAVE_STEPS}", failure=FailureKind.STALL)
    stall = record["events"][0]
    assert stall["message"].endswith("stalled: 127.0.0.3"), stall["message"]
    # The stopped host falls silent before the others stop advancing, or at the same time.
    assert stall["line"].startswith(f"stall at step {stall['step']}: no "), stall["line"]
    assert f"[supervisor] {stall['line']}" in stream.text
    summary = json.loads((output / RUN_SUMMARY_NAME).read_text())
    assert summary["recovery"]["events"][0]["event"] == FailureKind.STALL == "stall"
    print(
        f"rank SIGSTOP after checkpoint-{SAVE_STEPS}: {stall['line']}; noticed {stall['aware_at'] - stopped['at']:.1f} s after the stop"
    )


def stop_rank(tag: str) -> float:
    """SIGSTOP rank 1's training process; the time of the stop."""
    process = rank_process(tag)
    stopped_at = time.time()
    process.suspend()
    return stopped_at


def test_a_rank_killed_while_saving_resumes_from_the_previous_checkpoint(two_local_workers, train_data, tmp_path):
    output, tag = tmp_path / "out", uuid.uuid4().hex
    stream = StepStream(tmp_path / "output.log")
    caught: dict = {}
    catcher = threading.Thread(target=catch_mid_save, args=(output, tag, caught), daemon=True)
    catcher.start()
    record = run_supervised(two_local_workers, train_data, output, tag, stream)
    catcher.join(timeout=5)
    assert "killed" in caught, caught

    later = f"checkpoint-{2 * SAVE_STEPS}"
    assert_resumed_to_the_end(output, record, f"checkpoint-{SAVE_STEPS}")
    set_aside = output / f"{SET_ASIDE_PREFIX}{later}"
    assert set_aside.is_dir() and not (set_aside / COMPLETE_MARKER).exists()
    assert f"{later} is incomplete" in record["events"][1]["line"]
    assert f"as {SET_ASIDE_PREFIX}{later}" in stream.text, "the rank that set it aside did not name it"
    assert (output / later / COMPLETE_MARKER).is_file(), "the resumed run wrote its own complete checkpoint"


def catch_mid_save(output: Path, tag: str, caught: dict) -> None:
    """Make rank 1's shard of the second checkpoint a named pipe, wait until the rank opens it, SIGKILL it.

    The pipe is made as soon as the first checkpoint carries its completion marker: both ranks still have
    two steps (with their collectives) to go before the second save, so the rank cannot have reached it yet.
    """
    try:
        deadline = time.monotonic() + 600
        while not (output / f"checkpoint-{SAVE_STEPS}" / COMPLETE_MARKER).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint-{SAVE_STEPS} never completed")
            time.sleep(0.01)
        first = output / f"checkpoint-{SAVE_STEPS}" / f"global_step{SAVE_STEPS}"
        shard = next(first.glob(f"*_rank_{KILLED_RANK}_*optim_states.pt")).name
        state_dir = output / f"checkpoint-{2 * SAVE_STEPS}" / f"global_step{2 * SAVE_STEPS}"
        state_dir.mkdir(parents=True)
        os.mkfifo(state_dir / shard)
        # Returns once the rank has opened the pipe for writing: it is inside its save now.
        reader = os.open(state_dir / shard, os.O_RDONLY)
        rank_process(tag).kill()
        caught["killed"] = True
        os.close(reader)
    except Exception as error:  # noqa: BLE001 - reported by the test, in the main thread
        caught["error"] = repr(error)
