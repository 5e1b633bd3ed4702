"""A ZeRO checkpoint made loadable at another data-parallel size: DeepSpeed's universal checkpoint.

A ZeRO-1/2/3 checkpoint holds one optimizer shard per data-parallel rank, and DeepSpeed loads it only
at the size that wrote it. When a run goes on with fewer workers, :func:`convert` runs DeepSpeed's own
``ds_to_universal`` once on the checkpoint into ``checkpoint-N/global_stepN_universal`` beside the original, and the ranks load it with ``"checkpoint": {"load_universal": true}``
(:func:`load_universal`). A ZeRO-0 checkpoint has no shards: every rank's state is whole, so it loads at
any size as it is.

The conversion is complete or absent, as saves are: it is written under ``universal.partial/``, moved
into place, and only then does ``latest_universal`` name it. A conversion killed half-way leaves the
original checkpoint untouched and usable at its own size; the next conversion starts over.

Where it runs: ``ds_to_universal`` unpickles the checkpoint's files (``torch.load(weights_only=False)``), which
the workers wrote, so a worker that plants a pickle there runs code in whatever process converts it. The
supervisor therefore converts on one of the workers that go on (over the run's ssh, as the ranks are started),
where the ranks load those same files when they resume anyway: a planted file gains a worker nothing it did not
have. Only a checkpoint this machine's own ranks wrote (the local launcher, ``python -m`` by hand) is converted
in a child process here.

Usage::

    >>> seconds = convert(Path("runs/r1/checkpoint-200"), on_worker=partial(cluster.ssh_command, "127.0.0.2"))
    >>> load_universal(Path("runs/r1/checkpoint-200"), world_size=2)
    True
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from textsql.constants import PROJECT_DIR
from textsql.errors import LaunchError
from textsql.rundir.checkpoints import DEEPSPEED_LATEST_FILE, latest_state
from textsql.sanitize import sanitized
from worker.files import atomic_write

logger = logging.getLogger(__name__)

# Written by ds_to_universal beside the converted state: its tag, as "latest" names the original's.
UNIVERSAL_LATEST_FILE = "latest_universal"
UNIVERSAL_SUFFIX = "_universal"
UNIVERSAL_STATE_DIR = "zero"
# Where a conversion is written before it is moved into place.
STAGING_DIR = "universal.partial"
# One optimizer shard per data-parallel rank (ZeRO-1/2/3; bf16_ in front with DeepSpeed's bf16 optimizer).
ZERO_SHARD_GLOB = "*zero_pp_rank_*_optim_states.pt"


def state_dir(checkpoint: Path) -> Path | None:
    """The DeepSpeed state directory that ``latest`` names in a ``checkpoint-N`` (None when it names none inside
    it): checked here, where the conversion uses it, as :func:`textsql.rundir.checkpoints.incomplete_reason`
    checked it when the checkpoint was chosen.

    :rtype: pathlib.Path | None
    """
    return latest_state(checkpoint)[0]


def written_by(checkpoint: Path) -> int | None:
    """How many data-parallel ranks wrote the checkpoint's ZeRO optimizer state; None for ZeRO-0, whose
    state is whole on every rank and loads at any size.

    :rtype: int | None
    """
    state = state_dir(checkpoint)
    shards = len(list(state.glob(ZERO_SHARD_GLOB))) if state is not None else 0
    return shards or None


def converted(checkpoint: Path) -> Path | None:
    """The checkpoint's complete universal conversion, or None (never converted, or cut off while converting).

    :rtype: pathlib.Path | None
    """
    try:
        tag = (checkpoint / UNIVERSAL_LATEST_FILE).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    # ds_to_universal writes each parameter's state under zero/; the original's own state has none.
    if not tag or Path(tag).name != tag or not (checkpoint / tag / UNIVERSAL_STATE_DIR).is_dir():
        return None
    return checkpoint / tag


def needs_conversion(checkpoint: Path, world_size: int) -> bool:
    """Whether ranks of a world of ``world_size`` need a conversion of ``checkpoint`` that it does not have yet.

    :rtype: bool
    """
    writers = written_by(checkpoint)
    return writers is not None and writers != world_size and converted(checkpoint) is None


def load_universal(checkpoint: Path, world_size: int) -> bool:
    """Whether ranks of a world of ``world_size`` load ``checkpoint`` from its universal conversion.

    :rtype: bool
    :raises LaunchError: when it was written by another number of ranks and has no conversion (the
        message says how to get one).
    """
    writers = written_by(checkpoint)
    if writers is None or writers == world_size:
        return False
    if converted(checkpoint) is None:
        raise LaunchError(
            f"{checkpoint.name} was written by {writers} data-parallel ranks and this run has {world_size}; "
            f"resume with {writers} ranks, or convert it first: python -m {__name__} {checkpoint}"
        )
    return True


def conversion_command(checkpoint: Path) -> str:
    """The shell command that converts ``checkpoint`` on a worker: this very module, with the interpreter and
    ``PYTHONPATH`` the ranks use there (as :func:`textsql.launching.ranks.remote_end_command`).

    :rtype: str
    """
    return shlex.join(["env", f"PYTHONPATH={PROJECT_DIR}", sys.executable, "-m", __name__, str(checkpoint)])


def convert(checkpoint: Path, on_worker: Callable[[str], list[str]] | None = None) -> float:
    """Convert ``checkpoint`` for any data-parallel size with DeepSpeed's ``ds_to_universal`` (complete or absent:
    see the module docstring); its time in seconds.

    :param checkpoint: a complete ``checkpoint-N`` of ZeRO-1/2/3, at the same path on the worker.
    :param on_worker: turns the conversion's shell command into the command that runs it on a worker
        (``partial(cluster.ssh_command, host)``); None: a child process here, only for a checkpoint that no
        worker wrote (see the module docstring).
    :rtype: float
    :raises LaunchError: when the conversion fails (its last line and the fix), the original left as it was.
    """
    started = time.monotonic()
    command = (
        on_worker(conversion_command(checkpoint))
        if on_worker is not None
        else [sys.executable, "-m", __name__, str(checkpoint)]
    )
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as output:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait()
        finally:
            # ds_to_universal's pool of worker processes outlives a conversion that was killed or interrupted.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        output.seek(0)
        lines = output.read().strip().split("\n")
    if code != 0:
        raise LaunchError(
            f"converting {checkpoint.name} for another number of ranks failed (exit code {code}: "
            f"{sanitized(lines[-1]) or 'no output'}); {checkpoint.name} is unchanged: resume with the ranks that wrote it"
        )
    return time.monotonic() - started


def convert_here(checkpoint: Path) -> Path:
    """The conversion itself (what :func:`convert` runs in a child process): staged, moved, then named.

    :rtype: pathlib.Path
    :returns: the converted state directory.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    state = state_dir(checkpoint)
    if state is None:
        raise LaunchError(f"{checkpoint} has no DeepSpeed state ('{DEEPSPEED_LATEST_FILE}' names none)")
    target = checkpoint / f"{state.name}{UNIVERSAL_SUFFIX}"
    staging = checkpoint / STAGING_DIR
    (checkpoint / UNIVERSAL_LATEST_FILE).unlink(missing_ok=True)
    for stale in (staging, target):
        shutil.rmtree(stale, ignore_errors=True)
    workers = max(1, min(4, len(os.sched_getaffinity(0))))
    ds_to_universal(
        argparse.Namespace(
            input_folder=str(state),
            output_folder=str(staging / target.name),
            num_extract_workers=workers,
            num_merge_workers=max(1, workers // 2),
            keep_temp_folder=False,
            strict=True,
            # The trainer's engine records no universal-checkpoint info for a plain (not tensor-parallel) model.
            inject_missing_state=True,
        )
    )
    (staging / target.name).rename(target)
    shutil.rmtree(staging)
    atomic_write(checkpoint / UNIVERSAL_LATEST_FILE, target.name)
    return target


if __name__ == "__main__":
    try:
        convert_here(Path(sys.argv[1]))
    except (LaunchError, IndexError) as error:
        print(f"Error: {error or 'pass a checkpoint-N directory'}", file=sys.stderr)
        sys.exit(1)
