"""Checkpoints of a training run: which ones were written to the end, and so can be resumed.

The trainer writes ``checkpoint-N/`` and DeepSpeed its engine state inside it; a run killed while
saving leaves one without the last pieces, and ``--resume auto`` must skip it rather than fail.
"""
from __future__ import annotations

import logging
from pathlib import Path

from transformers.trainer_utils import sort_checkpoints

logger = logging.getLogger(__name__)

# The pieces of a checkpoint written last by the trainer and by DeepSpeed: a checkpoint without them
# was cut off while saving and cannot be resumed.
TRAINER_STATE_FILE = "trainer_state.json"
DEEPSPEED_LATEST_FILE = "latest"


def is_complete_checkpoint(path: Path) -> bool:
    """Whether a ``checkpoint-N`` directory was written to the end (trainer state and DeepSpeed tag).

    :rtype: bool
    """
    latest = path / DEEPSPEED_LATEST_FILE
    return (path / TRAINER_STATE_FILE).is_file() and latest.is_file() and (path / latest.read_text().strip()).is_dir()


def newest_complete_checkpoint(output: Path) -> str | None:
    """The highest-step complete checkpoint in ``output``, skipping ones cut off while saving.

    :rtype: str | None
    """
    if not output.is_dir():
        return None
    for checkpoint in reversed(sort_checkpoints(str(output))):
        if is_complete_checkpoint(Path(checkpoint)):
            return checkpoint
        logger.warning("skipping incomplete checkpoint %s", checkpoint)
    return None
