"""The trainer callback that marks a checkpoint complete (see :mod:`textsql.rundir.checkpoints`)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from textsql.arguments import output_path
from textsql.rundir.checkpoints import COMPLETE_MARKER, checkpoint_dir


class MarkComplete(TrainerCallback):
    """Marks each checkpoint complete once every rank has saved its part (a barrier, then rank 0 writes the marker)."""

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        from accelerate import PartialState

        # Each rank is here only after its own save returned: once all are, every shard is on disk.
        PartialState().wait_for_everyone()
        if state.is_world_process_zero:
            marker = checkpoint_dir(output_path(args), state.global_step) / COMPLETE_MARKER
            marker.write_text(f"global step {state.global_step}\n", encoding="utf-8")
