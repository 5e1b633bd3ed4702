"""Evaluation and checkpoints spaced by training time, not only by steps, so a bigger batch does not multiply their cost.

The trainer asks for an evaluation every ``--eval_steps`` steps and a checkpoint every ``--save_steps``;
when GPU batches hold a few hundred questions, that is an evaluation (constrained generation) every few
seconds of training. :class:`TimedSchedule` lets those requests through only when they are due:

- an evaluation, once the training time since the last one is at least the last one's measured duration
  x (1 - share) / share, so evaluation takes at most ``eval_share`` of the run (the first two at the first two
  ``--eval_steps`` boundaries: the first of a process also compiles the evaluation's graphs, a one-time cost
  that, taken for its duration, would hold the next one back by 19 times the compilation at a share of 0.05;
  the second measures what an evaluation costs);
- a checkpoint, once ``save_every_minutes`` have passed since the last one (or the start).

The steps stay the grid: a request comes only at a step boundary, never sooner. The last step's
evaluation and checkpoint always go through. Every rank must take the same decision (evaluation and
checkpoints are collective), so rank 0's is broadcast, at the boundaries only.

Usage::

    >>> schedule = TimedSchedule(eval_share=0.05, save_every_minutes=10)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger(__name__)


class TimedSchedule(TrainerCallback):
    """Hold back the step schedule's evaluations and checkpoints until they are due by time.

    :param eval_share: largest share of the run's time evaluation may take (``None`` or 0: every request).
    :param save_every_minutes: least time between checkpoints (``None`` or 0: every request).
    :param clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        eval_share: float | None,
        save_every_minutes: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.eval_share, self.save_every_minutes, self.clock = eval_share, save_every_minutes, clock
        self.last_save = clock()
        self.last_evaluation: tuple[float, float] | None = None  # (when it ended, how long it took)
        self.compiled = False  # the first evaluation of this process has run (and compiled what it runs)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.last_save = self.clock()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        timed = self.eval_share or self.save_every_minutes  # else the step grid rules, with no broadcast
        if not timed or not (control.should_evaluate or control.should_save) or state.global_step >= state.max_steps:
            return
        now = self.clock()
        evaluate = control.should_evaluate and self.evaluation_due(now)
        save = control.should_save and self.save_due(now)
        control.should_evaluate, control.should_save = agreed(evaluate, save, args.device)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        runtime = (metrics or {}).get("eval_runtime")
        if runtime is None:
            return
        if not self.compiled:
            self.compiled = True
            return
        self.last_evaluation = (self.clock(), float(runtime))

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.last_save = self.clock()

    def evaluation_due(self, now: float) -> bool:
        """Whether an evaluation now keeps evaluation within its share of the run.

        :rtype: bool
        """
        if not self.eval_share or self.last_evaluation is None:
            return True
        ended, took = self.last_evaluation
        return now - ended >= took * (1 - self.eval_share) / self.eval_share

    def save_due(self, now: float) -> bool:
        """Whether ``save_every_minutes`` have passed since the last checkpoint.

        :rtype: bool
        """
        return not self.save_every_minutes or now - self.last_save >= self.save_every_minutes * 60


def agreed(evaluate: bool, save: bool, device: torch.device) -> tuple[bool, bool]:
    """Rank 0's decisions, on every rank (each rank's clock differs a little; the actions are collective).

    :rtype: tuple[bool, bool]
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return evaluate, save
    # On the rank's device: NCCL broadcasts only accelerator tensors, gloo (CPU ranks) host ones.
    decisions = torch.tensor([evaluate, save], dtype=torch.uint8, device=device)
    torch.distributed.broadcast(decisions, src=0)
    evaluate_all, save_all = decisions.tolist()
    return bool(evaluate_all), bool(save_all)
