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


def incomplete_reason(path: Path) -> str | None:
    """Why a ``checkpoint-N`` directory cannot be resumed, or ``None`` when it was written to the end
    (trainer state, and a DeepSpeed ``latest`` tag naming a directory inside it).

    :rtype: str | None
    """
    if not (path / TRAINER_STATE_FILE).is_file():
        return f"no {TRAINER_STATE_FILE}"
    latest = path / DEEPSPEED_LATEST_FILE
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return f"no DeepSpeed '{DEEPSPEED_LATEST_FILE}' file"
    except UnicodeDecodeError:
        return f"its '{DEEPSPEED_LATEST_FILE}' file is not text"
    # An empty or path-like tag would name the checkpoint itself or a directory outside it.
    if not tag or Path(tag).name != tag or tag in (".", ".."):
        return f"its '{DEEPSPEED_LATEST_FILE}' file names no state directory ({tag!r})"
    if not (path / tag).is_dir():
        return f"its '{DEEPSPEED_LATEST_FILE}' file names {tag!r}, which is missing"
    return None


def is_complete_checkpoint(path: Path) -> bool:
    """Whether a ``checkpoint-N`` directory was written to the end (see :func:`incomplete_reason`).

    :rtype: bool
    """
    return incomplete_reason(path) is None


def newest_complete_checkpoint(output: Path) -> str | None:
    """The highest-step complete checkpoint in ``output``; each newer one skipped is logged with why.

    :rtype: str | None
    """
    if not output.is_dir():
        return None
    for checkpoint in reversed(sort_checkpoints(str(output))):
        reason = incomplete_reason(Path(checkpoint))
        if reason is None:
            return checkpoint
        logger.warning("skipping checkpoint %s: %s (cut off while saving?)", checkpoint, reason)
    return None
