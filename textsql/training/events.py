"""What a training run writes to TensorBoard: one run named after its directory, each scalar once.

HuggingFace's ``TensorBoardCallback`` writes to the directory it is given, so a run whose events lie
directly in ``RUN/tensorboard`` shows up as ``.`` in ``tensorboard --logdir RUN/tensorboard``; here the
events go one level down, ``RUN/tensorboard/<name of RUN>``. It also closes its writer when training
ends and opens a new event file for the final evaluation, which then repeats the last in-training
evaluation at the same step: :class:`ScalarsOnce` keeps one writer until :func:`close_run_events`
and writes each ``(tag, step)`` once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.integrations import TensorBoardCallback
from transformers.integrations.integration_utils import rewrite_logs

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from textsql.constants import TENSORBOARD_SUBDIR

logger = logging.getLogger(__name__)


def events_dir(output_dir: str | Path) -> Path:
    """Where a run's event files go: ``OUTPUT_DIR/tensorboard/<OUTPUT_DIR's name>``, so TensorBoard names the run.

    Usage::

        >>> events_dir("runs/demo")
        PosixPath('runs/demo/tensorboard/demo')

    :rtype: pathlib.Path
    """
    output = Path(output_dir)
    return output / TENSORBOARD_SUBDIR / (output.resolve().name or "run")


class ScalarsOnce(TensorBoardCallback):
    """``TensorBoardCallback`` with one event file per process and each ``(tag, step)`` written once."""

    def __init__(self, tb_writer: Any = None) -> None:
        super().__init__(tb_writer)
        self.written: set[tuple[str, int]] = set()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        fresh = {}
        for key, value in logs.items():
            if isinstance(value, (int, float)):
                # Tagged as the parent will write it (eval_loss -> eval/loss); strings (text) pass as they are.
                tag = (next(iter(rewrite_logs({key: value}))), state.global_step)
                if tag in self.written:
                    continue
                self.written.add(tag)
            fresh[key] = value
        if fresh:
            super().on_log(args, state, control, logs=fresh, **kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The final evaluation logs after training ends: keep this writer (and its file) for it.
        if self.tb_writer:
            self.tb_writer.flush()

    def close(self) -> None:
        """Close the event file (after the run's last scalar)."""
        if self.tb_writer:
            self.tb_writer.close()
            self.tb_writer = None


def use_run_events(trainer: Trainer) -> None:
    """Replace the trainer's ``TensorBoardCallback`` (``report_to`` tensorboard) with :class:`ScalarsOnce`.

    :param trainer: a ``transformers.Trainer``; left as it is when it does not report to TensorBoard.
    """
    if trainer.pop_callback(TensorBoardCallback) is not None:
        trainer.add_callback(ScalarsOnce())


def close_run_events(trainer: Trainer) -> None:
    """Close the run's event file, once the last scalar (the final evaluation) is written.

    :param trainer: the trainer :func:`use_run_events` set up.
    """
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ScalarsOnce):
            callback.close()
