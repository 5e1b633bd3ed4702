"""Checkpoints of a training run: which ones were written to the end, and so can be resumed.

The trainer writes ``checkpoint-N/`` and DeepSpeed its engine state inside it; a run killed while
saving leaves one without the last pieces, and ``--resume-from-checkpoint auto`` must skip it rather than fail.
DeepSpeed's ``save_checkpoint`` lets rank 0 write ``latest`` with no barrier before it, while other
ranks may still be writing their shards, so ``latest`` proves nothing on its own: a checkpoint
counts only once :class:`textsql.training.mark_complete.MarkComplete` wrote its marker, after every rank had
finished saving.

No torch or transformers here: the supervisor on the launching machine reads checkpoints too, and its start is
on the way to the first training step.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from worker.files import UnsafeRead, read_bounded

logger = logging.getLogger(__name__)

# The pieces of a checkpoint written last by the trainer and by DeepSpeed: a checkpoint without them
# was cut off while saving and cannot be resumed.
TRAINER_STATE_FILE = "trainer_state.json"
DEEPSPEED_LATEST_FILE = "latest"
# DeepSpeed's tags are "global_stepN"; anything much longer is not one.
MAX_TAG_BYTES = 1024
# Written by rank 0 into a checkpoint once every rank has finished writing it.
COMPLETE_MARKER = "textsql-complete"
# What an incomplete checkpoint is renamed to, out of the trainer's sight (its glob is checkpoint-*).
SET_ASIDE_PREFIX = "incomplete-"
# What each rank of a run of several writes into a checkpoint, beside its own DeepSpeed shards (transformers'
# Trainer._save_rng_state): the proof, on the machine that reads the checkpoint, that every rank's files reached it.
RANK_RNG_STATE_FILE = "rng_state_{rank}.pth"
# The trainer's checkpoint-N directories (transformers' PREFIX_CHECKPOINT_DIR; tests/test_train.py checks they agree).
CHECKPOINT_PREFIX = "checkpoint"
_CHECKPOINT_NAME = re.compile(rf"{CHECKPOINT_PREFIX}-(\d+)")


def checkpoint_dirs(output: Path) -> list[Path]:
    """The ``checkpoint-N`` directories in ``output``, oldest step first (the order of transformers' ``sort_checkpoints``).

    :rtype: list[pathlib.Path]
    """
    if not output.is_dir():
        return []
    steps = [
        (int(match[1]), path)
        for path in output.iterdir()
        if (match := _CHECKPOINT_NAME.fullmatch(path.name)) and path.is_dir()
    ]
    return [path for _, path in sorted(steps)]


def checkpoint_dir(output: Path, step: int) -> Path:
    """Where the trainer saves the checkpoint of ``step``.

    :rtype: pathlib.Path
    """
    return output / f"{CHECKPOINT_PREFIX}-{step}"


def incomplete_reason(path: Path) -> str | None:
    """Why a ``checkpoint-N`` directory cannot be resumed, or ``None`` when it was written to the end
    (trainer state, a DeepSpeed ``latest`` tag naming a directory inside it, and the marker that every
    rank had finished: see :class:`MarkComplete`).

    :rtype: str | None
    """
    if not (path / COMPLETE_MARKER).is_file():
        return f"no {COMPLETE_MARKER!r} marker (not every rank had finished writing it)"
    if not (path / TRAINER_STATE_FILE).is_file():
        return f"no {TRAINER_STATE_FILE}"
    return latest_state(path)[1]


def ranks_missing(path: Path, ranks: int) -> list[int]:
    """The ranks of a run of ``ranks`` whose files are not in the checkpoint ``path`` (empty for one rank, which
    writes them all): on hosts that do not share the run directory, each rank's files stay on its own host.

    :rtype: list[int]
    """
    if ranks <= 1:
        return []
    return [rank for rank in range(ranks) if not (path / RANK_RNG_STATE_FILE.format(rank=rank)).is_file()]


def latest_state(path: Path) -> tuple[Path | None, str | None]:
    """The DeepSpeed state directory that a ``checkpoint-N``'s ``latest`` names, checked each time it is read (a
    worker can rewrite ``latest`` between a check and a use): ``(directory, None)``, or ``(None, why not)``.

    :rtype: tuple[pathlib.Path | None, str | None]
    """
    try:
        tag = read_bounded(path / DEEPSPEED_LATEST_FILE, MAX_TAG_BYTES).decode("utf-8").strip()
    except FileNotFoundError:
        return None, f"no DeepSpeed '{DEEPSPEED_LATEST_FILE}' file"
    except UnicodeDecodeError:
        return None, f"its '{DEEPSPEED_LATEST_FILE}' file is not text"
    except (UnsafeRead, OSError):
        return None, f"its '{DEEPSPEED_LATEST_FILE}' is a link, not a file, or longer than any tag"
    # An empty or path-like tag would name the checkpoint itself or a directory outside it, as would a link.
    if not tag or Path(tag).name != tag or tag in (".", ".."):
        return None, f"its '{DEEPSPEED_LATEST_FILE}' file names no state directory ({tag!r})"
    state = path / tag
    if state.is_symlink() or not state.is_dir():
        return None, f"its '{DEEPSPEED_LATEST_FILE}' file names {tag!r}, which is missing or a link"
    return state, None


def is_complete_checkpoint(path: Path) -> bool:
    """Whether a ``checkpoint-N`` directory was written to the end (see :func:`incomplete_reason`).

    :rtype: bool
    """
    return incomplete_reason(path) is None


def newest_complete_checkpoint(output: Path) -> str | None:
    """The highest-step complete checkpoint in ``output``; each newer one skipped is logged with why.

    :rtype: str | None
    """
    for checkpoint in reversed(checkpoint_dirs(output)):
        reason = incomplete_reason(checkpoint)
        if reason is None:
            return str(checkpoint)
        logger.warning("skipping checkpoint %s: %s (cut off while saving?)", checkpoint, reason)
    return None


def incomplete_newer(output: Path) -> list[tuple[Path, str]]:
    """The checkpoints newer than the newest complete one in ``output``, newest first, each with why it
    cannot be resumed (what ``--resume-from-checkpoint auto`` skips and sets aside).

    :param output: the training output directory.
    :rtype: list[tuple[pathlib.Path, str]]
    """
    found = []
    for checkpoint in reversed(checkpoint_dirs(output)):
        reason = incomplete_reason(checkpoint)
        if reason is None:
            break
        found.append((checkpoint, reason))
    return found


def set_aside_incomplete(output: Path) -> list[Path]:
    """Rename each incomplete checkpoint newer than the newest complete one to ``incomplete-checkpoint-N``,
    so a resumed run neither loads nor rotates it; each is logged with why. Run on the saving rank only.

    :param output: the training output directory.
    :rtype: list[Path]
    :returns: where the incomplete checkpoints went.
    """
    moved = []
    for checkpoint, reason in incomplete_newer(output):
        target = output / f"{SET_ASIDE_PREFIX}{checkpoint.name}"
        shutil.rmtree(target, ignore_errors=True)
        checkpoint.rename(target)
        logger.warning("set aside incomplete checkpoint %s as %s: %s", checkpoint, target.name, reason)
        moved.append(target)
    return moved
