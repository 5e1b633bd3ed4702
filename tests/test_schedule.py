"""Evaluation and checkpoints spaced by training time: the step grid's requests pass only when due."""

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import DefaultFlowCallback

from textsql.errors import LaunchError
from textsql.planning.device_defaults import DeviceFacts, fast_defaults
from textsql.training.schedule import TimedSchedule


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("out")),
        eval_strategy="steps",
        eval_steps=10,
        save_steps=10,
        report_to=[],
        use_cpu=True,
    )


def simulate(args, schedule, clock, steps, step_seconds, eval_seconds, save_seconds=0.0, first_eval_seconds=None):
    """The trainer's loop as far as the schedule sees it: its flow callback, then ours; (evaluated, saved) steps.

    ``first_eval_seconds``: the first evaluation's duration when it differs (it compiles), else ``eval_seconds``.
    """
    state, control, flow = (
        TrainerState(max_steps=steps, eval_steps=10, save_steps=10),
        TrainerControl(),
        DefaultFlowCallback(),
    )
    schedule.on_train_begin(args, state, control)
    evaluated, saved = [], []
    for step in range(1, steps + 1):
        clock.now += step_seconds
        state.global_step = step
        flow.on_step_end(args, state, control)
        schedule.on_step_end(args, state, control)
        if control.should_evaluate:
            took = first_eval_seconds if first_eval_seconds is not None and not evaluated else eval_seconds
            clock.now += took
            schedule.on_evaluate(args, state, control, metrics={"eval_runtime": took})
            evaluated.append(step)
        if control.should_save:
            clock.now += save_seconds
            schedule.on_save(args, state, control)
            saved.append(step)
        control.should_evaluate = control.should_save = False
    return evaluated, saved


def test_evaluation_keeps_to_its_share_of_the_run_however_short_the_steps(args):
    clock = Clock()
    steps, step_seconds, eval_seconds = 5000, 0.1, 5.0
    evaluated, _ = simulate(args, TimedSchedule(0.05, None, clock), clock, steps, step_seconds, eval_seconds)
    share = len(evaluated) * eval_seconds / clock.now
    # The step grid alone: 500 evaluations, 2,500 s of evaluation against 500 s of training.
    assert evaluated[0] == 10 and evaluated[-1] == steps
    # Beyond the share: the first two evaluations (the first compiles, the second measures the cost) and the last
    # step's, which always runs.
    assert share <= 0.05 + 3 * eval_seconds / clock.now
    assert 5 <= len(evaluated) <= 10
    assert all(step % 10 == 0 for step in evaluated)


def test_the_first_evaluations_compilation_does_not_hold_back_the_next(args):
    """The first evaluation compiles (60 s here, against 3 s warm): its duration at a share of 0.05 would space
    the next 19 x 60 s = 1,140 s of training away; it is the second's 3 s that spaces the rest, 57 s."""
    clock = Clock()
    schedule = TimedSchedule(0.05, None, clock)
    evaluated, _ = simulate(args, schedule, clock, 1000, 1.0, 3.0, first_eval_seconds=60.0)
    assert evaluated[:2] == [10, 20]
    # A boundary every 10 s of training; 57 s after the second evaluation's end, the first boundary at or past it.
    assert evaluated[2] == 80
    assert schedule.last_evaluation[1] == 3.0


def test_without_a_share_or_minutes_every_boundary_evaluates_and_saves(args):
    clock = Clock()
    evaluated, saved = simulate(args, TimedSchedule(0, None, clock), clock, 50, 0.1, 5.0)
    assert evaluated == saved == [10, 20, 30, 40, 50]


def test_checkpoints_wait_for_their_minutes_and_the_last_step_always_saves(args):
    clock = Clock()
    # 1,000 steps of 1 s: a boundary every 10 s, a checkpoint every 5 minutes (300 s) and at the end.
    _, saved = simulate(args, TimedSchedule(None, 5, clock), clock, 1000, 1.0, 0.0)
    assert saved == [300, 600, 900, 1000]


def test_gpus_get_the_timed_schedule_and_cpus_the_step_grid(tmp_path, monkeypatch):
    from textsql.arguments import train_argv
    from textsql.planning import train_args as command_line

    gpu = DeviceFacts(cuda=True, memory_gib=80, gpus=1, cpu_cores=8)
    assert "eval_share" not in fast_defaults(DeviceFacts(cuda=False, cpu_cores=2))
    argv = train_argv(data_dir=str(tmp_path), run_dir=str(tmp_path))
    monkeypatch.setattr(command_line, "device_facts", lambda: gpu)
    _, _, run_args, _ = command_line.parse_command_line(argv)
    assert (run_args.eval_share, run_args.save_every_minutes) == (0.05, 10.0)
    _, _, run_args, _ = command_line.parse_command_line(argv + ["--eval_share", "0", "--save_every_minutes", "0"])
    assert (run_args.eval_share, run_args.save_every_minutes) == (0, 0)


@pytest.mark.parametrize(("flag", "value"), [("eval_share", "1"), ("eval_share", "-0.1"), ("save_every_minutes", "-1")])
def test_an_impossible_schedule_is_refused_naming_the_flag(tmp_path, flag, value):
    from textsql.arguments import train_argv
    from textsql.planning.train_args import parse_command_line

    with pytest.raises(LaunchError, match=f"pass --{flag.replace('_', '-')}"):
        parse_command_line(train_argv(data_dir=str(tmp_path), run_dir=str(tmp_path)) + [f"--{flag}", value])


def _decide(rank: int, port: int, results) -> None:
    import torch

    from textsql.training.schedule import agreed

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # Each rank's clock says something else; rank 0's word holds on both.
        results[rank] = agreed(rank == 0, rank == 1, torch.device("cpu"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two real gloo ranks
def test_every_rank_takes_rank_0s_decision():
    import torch.multiprocessing as mp

    from worker.network import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_decide, args=(free_port(), results), nprocs=2, join=True)
        assert dict(results) == {0: (True, False), 1: (True, False)}
