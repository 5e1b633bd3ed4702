"""The lines a rank prints for a person while DeepSpeed compiles its CPU op (textsql/training/progress.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.paths import PROJECT_DIR

from textsql.rank_lines import STAGE_PREFIX
from textsql.training.progress import (
    SHM_OP_NAME,
    announce_op_build,
    build_ops_with_pinned_ninja,
    op_built,
    tick_while_building,
)


def test_a_compiling_op_is_reported_every_interval_until_it_is_in_the_cache(tmp_path, capsys):
    ticks = threading.Thread(target=tick_while_building, args=(tmp_path, 0.05), daemon=True)
    ticks.start()
    seen = ""
    deadline = time.monotonic() + 30
    while seen.count("still compiling") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += capsys.readouterr().out
    assert seen.count("still compiling") >= 2, "a line every interval while the build runs"
    assert all(line.startswith(f"{STAGE_PREFIX}still compiling DeepSpeed's CPU op: ") for line in seen.splitlines())
    built = tmp_path / "py311_cpu" / SHM_OP_NAME / f"{SHM_OP_NAME}.so"
    built.parent.mkdir(parents=True)
    built.touch()
    assert op_built(tmp_path)
    ticks.join(timeout=30)
    assert not ticks.is_alive(), "the lines stop once the op is built"


@pytest.mark.parametrize("locked", [True, False])
def test_a_build_lock_already_in_the_cache_is_named_with_how_to_clear_it(locked, tmp_path, monkeypatch, capsys):
    import torch

    built = tmp_path / "py311_cpu" / SHM_OP_NAME / f"{SHM_OP_NAME}.so"
    built.parent.mkdir(parents=True)
    built.touch()  # built for another checkout's paths: torch rebuilds it, and waits on the lock first
    if locked:  # what a compile killed midway leaves: torch waits for it to go, forever
        (built.parent / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    announce_op_build()
    lines = capsys.readouterr().out.splitlines()
    if locked:
        assert len(lines) == 1 and lines[0].startswith(f"{STAGE_PREFIX}waiting on {built.parent / 'lock'}: ")
        assert "delete the file" in lines[0] and "killed" in lines[0]
    else:
        assert lines == []


def test_ops_are_built_by_the_pinned_ninja_even_with_another_first_on_path(tmp_path, monkeypatch):
    """Another ninja first on PATH (Debian's, in a shell without the venv's tools) would recompile an op cache the
    pinned one built, and the next launch recompile it back: every rank process asks for the pinned one."""
    other = tmp_path / "bin" / "ninja"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\necho 1.11.1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(other.parent), os.environ["PATH"]]))
    assert subprocess.check_output(["ninja", "--version"], text=True).strip() == "1.11.1"
    build_ops_with_pinned_ninja()
    pinned = re.search(r"^ninja==(\S+)", (PROJECT_DIR / "requirements.txt").read_text(), re.MULTILINE)
    assert pinned, "requirements.txt pins ninja"
    assert subprocess.check_output(["ninja", "--version"], text=True).startswith(pinned.group(1))
    assert (
        Path(subprocess.check_output(["sh", "-c", "command -v ninja"], text=True).strip()).parent
        == Path(sys.executable).parent
    )


def test_the_heartbeat_reports_steps_evaluations_and_saves_until_training_ends(capsys):
    from textsql.rank_lines import HEARTBEAT_LINE
    from textsql.training.progress import Heartbeat

    heartbeat, args, state = (
        Heartbeat(interval_s=0.05),
        SimpleNamespace(process_index=1),
        SimpleNamespace(global_step=2),
    )
    heartbeat.on_train_begin(args, state, None)
    state.global_step = 3
    heartbeat.on_step_end(args, state, None)
    heartbeat.on_prediction_step(args, state, None)
    heartbeat.on_save(args, state, None)
    seen = ""
    deadline = time.monotonic() + 30
    while "progress 3" not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += capsys.readouterr().out
    last = HEARTBEAT_LINE.match(seen.splitlines()[-1])
    assert (last["rank"], last["step"], last["progress"]) == ("1", "3", "3"), seen
    heartbeat.on_train_end(args, state, None)
    heartbeat.thread.join(timeout=30)
    assert not heartbeat.thread.is_alive(), "the heartbeat stops when training ends"


def test_on_a_worker_pod_the_heartbeat_goes_to_the_pods_agent_too(monkeypatch, capsys):
    from textsql.training.progress import Heartbeat
    from worker.beats import Beat, BeatInbox
    from worker.constants import ENV_BEAT_SOCKET

    with BeatInbox() as inbox:
        monkeypatch.setenv(ENV_BEAT_SOCKET, inbox.path)
        heartbeat, state = Heartbeat(interval_s=0.05), SimpleNamespace(global_step=2)
        heartbeat.on_train_begin(SimpleNamespace(process_index=1), state, None)
        heard: list[Beat] = []
        deadline = time.monotonic() + 30
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
            heard += inbox.drain()
        heartbeat.on_train_end(None, state, None)
        heartbeat.thread.join(timeout=30)
    assert heard == [Beat(rank=1, step=2, progress=0)]
    assert "heartbeat rank 1 step 2 progress 0" in capsys.readouterr().out, "and its line, for hosts without one"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_lines_say_the_time_left_once_the_first_evaluation_and_checkpoint_are_behind(capsys):
    """Rank 0's lines as the trainer calls them: 60 s of start-up, 1 s a step, at step 20 an evaluation (10 s) and a
    checkpoint (5 s); the supervisor's and the displays' reader (STEP_LINE) finds the time left in them."""
    from transformers import TrainerControl, TrainerState

    from textsql.rank_lines import STEP_LINE
    from textsql.training.progress import StepLines

    clock, args = Clock(), SimpleNamespace(eval_strategy="steps", save_strategy="steps")
    lines = StepLines(clock=clock)
    state, control = TrainerState(max_steps=40, eval_steps=20, save_steps=20), TrainerControl()
    lines.on_train_begin(args, state, control)
    clock.now = 60.0
    for step in range(10, 41, 10):
        clock.now += 10
        state.global_step = step
        lines.on_log(args, state, control, logs={"loss": 3.0})
        if step == 20:
            clock.now += 10
            lines.on_log(args, state, control, logs={"eval_loss": 2.5, "eval_lf_accuracy": 0.5, "eval_runtime": 10})
            clock.now += 5
            lines.on_save(args, state, control)
    said = [STEP_LINE.match(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["step"], line["text"], line["elapsed"], line["left"]) for line in said] == [
        ("10", "loss 3.000", "70", None),
        ("20", "loss 3.000", "80", None),
        ("20", "eval loss 2.500, lf_accuracy 0.500", "90", None),
        ("30", "loss 3.000", "105", "10"),
        ("40", "loss 3.000", "115", "0"),
    ]
    record = lines.record()
    assert record["steady_from_step"] == 20 and record["seconds_per_step"] == 1.0
    assert record["time_left_at_evaluations"] == [{"step": 20, "elapsed_s": 90.0, "time_left_s": None}]


@pytest.mark.parametrize(("eval_strategy", "opened"), [("no", 10), ("steps", 30)])
def test_the_final_evaluation_after_training_is_no_pause_of_the_run(eval_strategy, opened, capsys):
    """1 s a step to max_steps 40 (no evaluation, or one every 30 steps, which 40 is not a multiple of), then
    trainer.train() ends and the final evaluation takes 150 s: the pace stays the steps' 1.0 (counted as a pause
    after the last step it read 6.0 without evaluations, 16.0 with them), and its line says no time left."""
    from transformers import TrainerControl, TrainerState

    from textsql.rank_lines import STEP_LINE
    from textsql.training.progress import StepLines

    clock, args = Clock(), SimpleNamespace(eval_strategy=eval_strategy, save_strategy="no")
    lines = StepLines(clock=clock)
    state, control = TrainerState(max_steps=40, eval_steps=30), TrainerControl()
    lines.on_train_begin(args, state, control)
    clock.now = 60.0
    for step in range(10, 41, 10):
        clock.now += 10
        state.global_step = step
        lines.on_log(args, state, control, logs={"loss": 3.0})
        if eval_strategy == "steps" and step == 30:
            clock.now += 20
            lines.on_log(args, state, control, logs={"eval_loss": 2.8})
    lines.on_train_end(args, state, control)
    clock.now += 150
    lines.on_log(args, state, control, logs={"eval_loss": 2.5, "eval_runtime": 150})
    record = lines.record()
    assert record["steady_from_step"] == opened and record["seconds_per_step"] == 1.0
    final = STEP_LINE.match(capsys.readouterr().out.splitlines()[-1])
    assert (final["step"], final["text"], final["left"]) == ("40", "eval loss 2.500", None)
    assert [said["step"] for said in record["time_left_at_evaluations"]] == [30] * (eval_strategy == "steps")
