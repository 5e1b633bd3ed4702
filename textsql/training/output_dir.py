"""The run's output directory: a previous run refused or cleared, the checkpoint to resume, ``model/`` written whole.

A previous run's checkpoints or model are never deleted unless ``--overwrite-output-dir`` asks;
``--resume-from-checkpoint`` names the checkpoint the training resumes from (``auto``: the newest complete one, :mod:`textsql.rundir.checkpoints`).
The model directory is written to a staging directory and renamed, so a crash never leaves a half-written ``model/``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from textsql.arguments import RunArguments, output_path
from textsql.constants import MODEL_SUBDIR
from textsql.errors import LaunchError
from textsql.rundir.checkpoints import incomplete_reason, newest_complete_checkpoint, set_aside_incomplete

if TYPE_CHECKING:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

logger = logging.getLogger(__name__)


def prepare_output_dir(args: Seq2SeqTrainingArguments, run_args: RunArguments) -> str | None:
    """Prepare the output directory on the saving rank, make the others wait, and pick the checkpoint.

    A previous run's checkpoints or model are never deleted unless ``--overwrite-output-dir`` asks;
    without it (and without ``--resume-from-checkpoint``) such a directory is refused.

    :returns: the checkpoint to resume from, or ``None`` for a fresh start.
    :rtype: str | None
    """
    from accelerate import PartialState

    output = output_path(args)
    if args.should_save:
        _prepare_on_saving_rank(output, args.resume_from_checkpoint, run_args)
    PartialState().wait_for_everyone()
    checkpoint = resume_checkpoint(output, args.resume_from_checkpoint)
    if args.resume_from_checkpoint == "auto":
        if checkpoint is None:
            logger.warning("--resume-from-checkpoint auto: no complete checkpoint in %s, starting fresh", output)
        else:
            logger.warning("--resume-from-checkpoint auto: resuming from %s", checkpoint)
    return checkpoint


def resume_checkpoint(output: Path, resume: str | None) -> str | None:
    """The checkpoint ``--resume-from-checkpoint`` names: the newest complete one in ``output`` for ``auto``, else the path given.

    :rtype: str | None
    :raises LaunchError: when a path given is not a complete checkpoint.
    """
    if not resume:
        return None
    if resume == "auto":
        return newest_complete_checkpoint(output)
    reason = incomplete_reason(Path(resume))
    if reason is not None:
        raise LaunchError(
            f"{resume!r} is not a complete checkpoint ({reason}); pass --resume-from-checkpoint auto or another checkpoint-N directory"
        )
    return resume


def _prepare_on_saving_rank(output: Path, resume: str | None, run_args: RunArguments) -> None:
    previous = [*output.glob("checkpoint-*"), output / MODEL_SUBDIR] if output.is_dir() else []
    previous = [path for path in previous if path.exists()]
    if previous and not resume:
        if not run_args.overwrite_output_dir:
            raise LaunchError(
                f"run directory {str(output)!r} holds a previous run ({previous[0].name}); "
                "pass --resume-from-checkpoint auto to resume it, --overwrite-output-dir to replace it, or another "
                "--run-dir (in notebook 02: resume_from_checkpoint='auto', overwrite_output_dir=True, or another run_dir)"
            )
        for path in previous:
            logger.warning("deleting %s of a previous run (--overwrite-output-dir)", path)
            shutil.rmtree(path)
    if resume == "auto":
        set_aside_incomplete(output)
    output.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(_staging(output / MODEL_SUBDIR), ignore_errors=True)


def export_model(trainer: Seq2SeqTrainer, target: Path, prepare_record: Path | None = None) -> None:
    """Write a consolidated HuggingFace model directory (weights, config, tokenizer, generation config).

    ``prepare_record`` (the dataset's ``prepare.json``) is copied beside the weights, so inference on
    a user's own question builds the model input the way training saw it.

    Every rank takes part (ZeRO-3 gathers its shards); the world's main process writes to a staging
    directory and renames it, so a crash never leaves a half-written ``model/``.
    """
    staging = _staging(target)
    trainer.save_model(str(staging))
    if trainer.is_world_process_zero():
        if prepare_record is not None and prepare_record.is_file():
            shutil.copy2(prepare_record, staging / prepare_record.name)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        logger.info("model written to %s", target)
    trainer.accelerator.wait_for_everyone()


def _staging(path: Path) -> Path:
    return path.with_name(path.name + ".partial")
