"""What goes to the store and comes back: checkpoints marked complete by one object written last, the newest one
downloaded, retention as ``save_total_limit``, and the run's outputs at its end.

A checkpoint in the store is ``ROOT/checkpoint-N/...``, the run directory's layout; it counts as complete only once
``ROOT/checkpoint-N/textsql-complete`` exists, which is written after every other file of it (and removed first
when a checkpoint is uploaded again or deleted). An upload cut off half-way leaves files without the marker, which
nothing ever chooses. An emptied prefix may still list as a directory (SeaweedFS does): only markers are counted.

Usage::

    >>> upload_checkpoint(store, Path("runs/r1/checkpoint-200"))
    48213504
    >>> complete_steps(store)
    [100, 200]
    >>> download_newest(store, Path("runs/r2"))
    PosixPath('runs/r2/checkpoint-200')
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from textsql.constants import METRICS_NAME, MODEL_SUBDIR, RUN_SUMMARY_NAME, TENSORBOARD_SUBDIR
from textsql.rundir.checkpoints import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    checkpoint_dir,
    checkpoint_dirs,
    is_complete_checkpoint,
)
from textsql.store.location import Store

logger = logging.getLogger(__name__)

_MARKED = re.compile(rf"{CHECKPOINT_PREFIX}-(\d+)/{COMPLETE_MARKER}$")
# Where a download is written before it is renamed into place (out of the trainer's checkpoint-* glob).
DOWNLOAD_PREFIX = ".download-"
# The trainer's and the evaluation's metrics files beside run.json (save_metrics writes *_results.json).
RESULTS_GLOB = "*results.json"


def files_of(directory: Path) -> list[Path]:
    """The regular files under ``directory``, links left out (a worker's link could name any file here).

    :rtype: list[pathlib.Path]
    """
    return sorted(path for path in directory.rglob("*") if path.is_file() and not path.is_symlink())


def put_files(store: Store, base: Path, files: list[Path]) -> int:
    """Copy ``files`` (under ``base``) to the same relative paths under the store's root.

    :returns: the bytes copied.
    :rtype: int
    """
    if files:
        store.fs.put([str(path) for path in files], [store.path(*path.relative_to(base).parts) for path in files])
    return sum(path.stat().st_size for path in files)


def upload_checkpoint(store: Store, checkpoint: Path) -> int:
    """Copy a complete ``checkpoint-N`` to the store, then mark it complete there (its marker written last).

    :returns: the bytes copied.
    :rtype: int
    :raises FileNotFoundError: when the checkpoint's files vanish while being copied (the trainer rotated it).
    """
    marker = store.path(checkpoint.name, COMPLETE_MARKER)
    # An earlier copy of the same step (a run resumed before it) stops counting before any file of it changes.
    if store.fs.exists(marker):
        store.fs.rm(marker)
    copied = put_files(
        store, checkpoint.parent, [path for path in files_of(checkpoint) if path.name != COMPLETE_MARKER]
    )
    store.fs.pipe(marker, (checkpoint / COMPLETE_MARKER).read_bytes())
    return copied


def complete_steps(store: Store) -> list[int]:
    """The steps of the checkpoints marked complete in the store, oldest first.

    :rtype: list[int]
    """
    store.fs.invalidate_cache()
    prefix = store.path("")
    markers = store.fs.glob(store.path(f"{CHECKPOINT_PREFIX}-*", COMPLETE_MARKER))
    return sorted(int(found[1]) for path in markers if (found := _MARKED.search(path.removeprefix(prefix))))


def download_newest(store: Store, output: Path) -> Path | None:
    """Download the store's newest complete checkpoint into ``output``, unless ``output`` holds one as new.

    It is written beside, then renamed into place: a download cut off never looks like a checkpoint.

    :returns: the downloaded checkpoint, or None when there was nothing newer to download.
    :rtype: pathlib.Path | None
    """
    steps = complete_steps(store)
    local = [int(path.name.rpartition("-")[2]) for path in checkpoint_dirs(output) if is_complete_checkpoint(path)]
    if not steps or (local and max(local) >= steps[-1]):
        return None
    target = checkpoint_dir(output, steps[-1])
    staging = output / f"{DOWNLOAD_PREFIX}{target.name}"
    shutil.rmtree(staging, ignore_errors=True)
    output.mkdir(parents=True, exist_ok=True)
    store.fs.get(store.path(target.name), str(staging), recursive=True)
    if not is_complete_checkpoint(staging):
        raise FileNotFoundError(f"{target.name} in the store is marked complete but its files are not all there")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def apply_retention(store: Store, keep: int | None) -> list[int]:
    """Delete from the store the complete checkpoints older than the newest ``keep`` (the trainer's
    ``save_total_limit``), and the unmarked leftovers older than the newest complete one; markers go first.

    :returns: the steps deleted.
    :rtype: list[int]
    """
    steps = complete_steps(store)
    if not steps:
        return []
    doomed = steps[:-keep] if keep else []
    leftovers = [
        step
        for path in store.fs.glob(store.path(f"{CHECKPOINT_PREFIX}-*"))
        if (step := _step_of(path)) is not None and step < steps[-1] and step not in steps
    ]
    return _delete(store, doomed, leftovers)


def clear_checkpoints(store: Store) -> list[int]:
    """Delete every checkpoint from the store (a run that replaces a previous one); markers go first.

    :returns: the steps deleted.
    :rtype: list[int]
    """
    marked = complete_steps(store)
    found = [
        step for path in store.fs.glob(store.path(f"{CHECKPOINT_PREFIX}-*")) if (step := _step_of(path)) is not None
    ]
    return _delete(store, marked, [step for step in found if step not in marked])


def _delete(store: Store, marked: list[int], unmarked: list[int]) -> list[int]:
    for step in marked:
        store.fs.rm(store.path(f"{CHECKPOINT_PREFIX}-{step}", COMPLETE_MARKER))
    for step in [*marked, *unmarked]:
        store.fs.rm(store.path(f"{CHECKPOINT_PREFIX}-{step}"), recursive=True)
    return sorted([*marked, *unmarked])


def upload_outputs(store: Store, output: Path) -> int:
    """Copy the run's outputs: ``model/`` with its model card, ``run.json``, the metrics and the event files.

    :returns: the bytes copied.
    :rtype: int
    """
    files = [
        *files_of(output / MODEL_SUBDIR),
        *files_of(output / TENSORBOARD_SUBDIR),
        *sorted(output.glob(RESULTS_GLOB)),
        *[path for path in (output / METRICS_NAME, output / RUN_SUMMARY_NAME) if path.is_file()],
    ]
    return put_files(store, output, [path for path in files if not path.is_symlink()])


def _step_of(path: str) -> int | None:
    found = re.search(rf"{CHECKPOINT_PREFIX}-(\d+)$", path.rstrip("/"))
    return int(found[1]) if found else None
