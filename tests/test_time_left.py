"""The time left of a run, measured against a fake clock: start-up and compile never count, evaluations and
checkpoints do, spread over the steps that remain."""

from __future__ import annotations

import pytest

from textsql.training.time_left import TimeLeft, steady_from

MAX_STEPS = 1000
LOG_EVERY = 10
STEP_S = 1.0
COMPILE_S = 120.0  # start-up and the first step's compile, all before the first logged step
EVAL_EVERY, EVAL_S = 100, 20.0
FIRST_EVAL_S = 90.0  # the first evaluation compiles generation too
SAVE_S = 10.0


def run(left: TimeLeft, until: int) -> tuple[list[tuple[int, float | None]], float]:
    """Drive ``left`` as a rank does: a step every STEP_S after COMPILE_S, an observation every LOG_EVERY steps,
    then at each EVAL_EVERY an evaluation and a checkpoint, each observed when it ends.

    :returns: ``(step, time left said)`` at each logged step, and the clock at ``until``.
    """
    now, said = COMPILE_S, []
    for step in range(1, until + 1):
        now += STEP_S
        if step % LOG_EVERY == 0:
            left.observe(step, now)
            said.append((step, left.seconds_left()))
        if step % EVAL_EVERY == 0:
            now += FIRST_EVAL_S if step == EVAL_EVERY else EVAL_S
            left.observe(step, now)
            now += SAVE_S
            left.observe(step, now)
    return said, now


def true_left(step: int) -> float:
    """What a step of this schedule really has left: its steps, and the evaluations and checkpoints after it."""
    pauses = len([every for every in range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY) if every >= step])
    return (MAX_STEPS - step) * STEP_S + pauses * (EVAL_S + SAVE_S)


def test_nothing_is_said_until_the_first_evaluation_and_checkpoint_are_behind():
    said, _ = run(TimeLeft(MAX_STEPS, steady_from(0, MAX_STEPS, EVAL_EVERY, EVAL_EVERY)), 110)
    assert [step for step, left in said if left is None] == list(range(10, 101, 10))
    assert said[-1][1] is not None


def test_at_each_evaluation_the_estimate_is_what_is_really_left():
    """Right after an evaluation and its checkpoint the window holds whole periods: the pace is exact. Counting
    the compile (120 s) or the slow first evaluation, or leaving the pauses out, would miss by far more."""
    left = TimeLeft(MAX_STEPS, steady_from(0, MAX_STEPS, EVAL_EVERY, EVAL_EVERY))
    for evaluation in range(200, MAX_STEPS, EVAL_EVERY):
        run(left := TimeLeft(MAX_STEPS, left.steady_from), evaluation)
        assert left.seconds_left() == pytest.approx(true_left(evaluation) - EVAL_S - SAVE_S, rel=1e-9), evaluation


def test_between_evaluations_it_lies_between_the_steps_alone_and_the_truth():
    """Never above the truth (the compile and the slow first evaluation are out), never below the steps alone
    (the pauses in the window count); until a second evaluation is in the window the pauses to come are not
    known yet, and from then on it stays within one evaluation and checkpoint of the truth."""
    left = TimeLeft(MAX_STEPS, steady_from(0, MAX_STEPS, EVAL_EVERY, EVAL_EVERY))
    said, _ = run(left, MAX_STEPS)
    for step, estimate in said:
        if step > EVAL_EVERY:
            assert estimate is not None
            assert (MAX_STEPS - step) * STEP_S <= estimate <= true_left(step), step
        if step > 2 * EVAL_EVERY:
            assert true_left(step) - estimate <= EVAL_S + SAVE_S, step
    assert said[-1] == (MAX_STEPS, 0.0)


def test_the_compile_does_not_count():
    """Steady from the first logged step where no evaluation comes before the end: the compile before it is out."""
    left = TimeLeft(MAX_STEPS, steady_from(0, MAX_STEPS, None, None))
    assert left.steady_from == 0
    left.observe(10, COMPILE_S + 10)
    assert left.seconds_left() is None
    left.observe(20, COMPILE_S + 20)
    assert left.seconds_per_step() == STEP_S and left.seconds_left() == (MAX_STEPS - 20) * STEP_S


def test_a_checkpoint_pause_is_spread_over_the_steps_left():
    """Checkpoints alone (no evaluation split): steady after the first one; a later 50 s save every 20 steps adds
    2.5 s to each step's second, also while the next period's is still to come."""
    left = TimeLeft(100, steady_from(0, 100, None, 20))
    assert left.steady_from == 20
    left.observe(20, 200.0)
    left.observe(20, 250.0)  # the first checkpoint's end opens the window
    left.observe(40, 270.0)
    assert left.seconds_left() == 60.0
    left.observe(40, 320.0)  # the second checkpoint: 50 s
    assert left.seconds_left() == 60 * (1.0 + 50.0 / 20)
    left.observe(60, 340.0)
    assert left.seconds_per_step() == 1.0 + 50.0 / 20 and left.seconds_left() == 40 * 3.5


def test_it_counts_down_between_observations_and_stops_at_zero():
    left = TimeLeft(100, 0)
    left.observe(10, 0.0)
    left.observe(20, 20.0)
    assert left.seconds_left(now=50.0) == 160.0 - 30.0
    assert left.seconds_left(now=1000.0) == 0.0


@pytest.mark.parametrize(
    ("start", "max_steps", "eval_every", "save_every", "expected"),
    [
        (0, 2000, 500, 500, 500),
        (1000, 2000, 500, 500, 1500),  # resumed from checkpoint-1000: its next evaluation
        (1200, 2000, 500, 500, 1500),
        (0, 2000, 500, 100, 500),  # the first evaluation, not the checkpoints before it
        (0, 4, 4, 4, 0),  # only the last step evaluates: the first observation opens the window
        (0, 2000, None, 300, 300),
        (0, 2000, None, None, 0),
    ],
)
def test_the_window_opens_after_the_first_evaluation_of_the_schedule(
    start, max_steps, eval_every, save_every, expected
):
    assert steady_from(start, max_steps, eval_every, save_every) == expected


def test_work_after_the_last_step_is_no_pause():
    """The last step's evaluation and the model's save (in training or after it) have no step left to be spread
    over: the pace stays the steps' and its pauses' before it."""
    left = TimeLeft(100, steady_from(0, 100, None, 20))
    left.observe(20, 200.0)
    left.observe(20, 250.0)  # the first checkpoint opens the window
    left.observe(40, 270.0)
    left.observe(40, 320.0)  # a checkpoint within the run: 50 s over 20 steps
    left.observe(100, 380.0)
    left.observe(100, 430.0)  # the last step's checkpoint
    left.observe(100, 580.0)  # the final evaluation
    assert left.seconds_per_step() == 1.0 + 50.0 / 20 and left.seconds_left() == 0.0
