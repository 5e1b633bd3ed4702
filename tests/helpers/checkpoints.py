"""A checkpoint as the trainer and DeepSpeed leave it once every rank saved it, without training for it."""

from pathlib import Path

from textsql.rundir.checkpoints import COMPLETE_MARKER, DEEPSPEED_LATEST_FILE, TRAINER_STATE_FILE


def complete_checkpoint(run_dir: Path, step: int) -> Path:
    """``run_dir/checkpoint-STEP`` with the pieces that make it complete (textsql.rundir.checkpoints)."""
    checkpoint = run_dir / f"checkpoint-{step}"
    (checkpoint / f"global_step{step}").mkdir(parents=True)
    (checkpoint / DEEPSPEED_LATEST_FILE).write_text(f"global_step{step}")
    (checkpoint / TRAINER_STATE_FILE).write_text("{}")
    (checkpoint / COMPLETE_MARKER).write_text("")
    return checkpoint
