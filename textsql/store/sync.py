"""What goes to the store and comes back: checkpoints marked complete by one object written last, the newest one
downloaded, retention as ``save_total_limit``, and the run's outputs at its end.

A checkpoint in the store is ``ROOT/checkpoint-N/...``, the run directory's layout; it counts as complete only once
``ROOT/checkpoint-N/textsql-complete`` exists, which is written after every other file of it (and removed first
when a checkpoint is uploaded again or deleted). An upload cut off half-way leaves files without the marker, which
nothing ever chooses. An emptied prefix may still list as a directory (SeaweedFS does): only markers are counted.

The run directory is the workers' to write: every copy goes by descriptor, never through a link
(:mod:`textsql.store.copying`), and a download is made in a fresh directory of this process's own, renamed into
place whole.

Usage::

    >>> upload_checkpoint(store, Path("runs/r1/checkpoint-200"))
    48213504
    >>> complete_steps(store)
    [100, 200]
    >>> download_newest(store, Path("runs/r2"))
    PosixPath('runs/r2/checkpoint-200')
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from textsql.constants import METRICS_NAME, MODEL_SUBDIR, RUN_SUMMARY_NAME, TENSORBOARD_SUBDIR
from textsql.errors import StoreError
from textsql.rundir.checkpoints import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    checkpoint_dir,
    checkpoint_dirs,
    is_complete_checkpoint,
)
from textsql.store.copying import download_tree, upload_file, upload_subdirectory, upload_tree
from textsql.store.location import Store, refusal
from worker.files import UnsafePath, UnsafeRead, opened_directory, read_bounded

logger = logging.getLogger(__name__)

_MARKED = re.compile(rf"{CHECKPOINT_PREFIX}-(\d+)/{COMPLETE_MARKER}$")
# Where a download is written before it is renamed into place (out of the trainer's checkpoint-* glob).
DOWNLOAD_PREFIX = ".download-"
# The marker the ranks write is empty; anything much longer is not one.
MAX_MARKER_BYTES = 4096
# A downloaded checkpoint's directory, as the trainer's own are (under the usual umask): the ranks read it.
DOWNLOADED_DIR_MODE = 0o755
# The trainer's and the evaluation's metrics files beside run.json (save_metrics writes *_results.json).
RESULTS_GLOB = "*results.json"


def upload_checkpoint(store: Store, checkpoint: Path) -> int:
    """Copy a complete ``checkpoint-N`` to the store, then mark it complete there (its marker written last).

    :returns: the bytes copied.
    :rtype: int
    :raises FileNotFoundError: when the checkpoint's files vanish while being copied (the trainer rotated it).
    :raises worker.files.UnsafePath: when the checkpoint or its marker is a link or not what it should be.
    """
    marker = store.path(checkpoint.name, COMPLETE_MARKER)
    # An earlier copy of the same step (a run resumed before it) stops counting before any file of it changes.
    if store.fs.exists(marker):
        store.fs.rm(marker)
    with opened_directory(checkpoint) as directory:
        copied = upload_tree(store, directory, (checkpoint.name,), leave_out={COMPLETE_MARKER})
        store.fs.pipe(marker, _marker_bytes(directory, checkpoint.name))
    return copied


def _marker_bytes(directory: int, name: str) -> bytes:
    """The marker the ranks wrote, read as a worker's file is (bounded, not through a link)."""
    try:
        return read_bounded(COMPLETE_MARKER, MAX_MARKER_BYTES, dir_fd=directory)
    except UnsafeRead:
        kind = f"not a regular file of at most {MAX_MARKER_BYTES} bytes"
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        kind = "a symbolic link"
    raise UnsafePath(
        f"refusing to mark {name} complete in the checkpoint store: {name}'s {COMPLETE_MARKER} is {kind}, not the "
        "ranks' marker; remove it"
    )


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

    It is written into a fresh directory this process makes (:func:`tempfile.mkdtemp`, a name no worker could
    plant a link at beforehand), each file new, then renamed into place: a download cut off never looks like a
    checkpoint.

    :returns: the downloaded checkpoint, or None when there was nothing newer to download.
    :rtype: pathlib.Path | None
    :raises StoreError: in one line, when the download fails or its files are not all there.
    """
    steps = complete_steps(store)
    local = [int(path.name.rpartition("-")[2]) for path in checkpoint_dirs(output) if is_complete_checkpoint(path)]
    if not steps or (local and max(local) >= steps[-1]):
        return None
    target = checkpoint_dir(output, steps[-1])
    output.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{DOWNLOAD_PREFIX}{target.name}-", dir=output))
    try:
        with opened_directory(staging) as directory:
            download_tree(store, store.path(target.name), directory)
            os.fchmod(directory, DOWNLOADED_DIR_MODE)
        if not is_complete_checkpoint(staging):
            raise StoreError(
                f"checkpoint store {store.where()}: {target.name} is marked complete but its files are not all there; "
                "delete it from the store, or resume from another store prefix"
            )
        _replace(target, staging)
    except (OSError, UnsafePath) as error:
        raise StoreError(
            f"checkpoint store {store.where()}: downloading {target.name} failed: {refusal(error)}"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _replace(target: Path, staging: Path) -> None:
    """Rename ``staging`` to ``target``, removing what is there first: a link itself (never what it names), or a
    directory (``shutil.rmtree`` does not follow the links in it)."""
    try:
        target.unlink()
    except IsADirectoryError:
        shutil.rmtree(target)
    except FileNotFoundError:
        pass
    staging.rename(target)


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
    with opened_directory(output) as directory:
        copied = sum(upload_subdirectory(store, directory, name) for name in (MODEL_SUBDIR, TENSORBOARD_SUBDIR))
        for name in sorted(os.listdir(directory)):
            if fnmatch.fnmatch(name, RESULTS_GLOB) or name in (METRICS_NAME, RUN_SUMMARY_NAME):
                copied += upload_file(store, directory, (name,))
    return copied


def _step_of(path: str) -> int | None:
    found = re.search(rf"{CHECKPOINT_PREFIX}-(\d+)$", path.rstrip("/"))
    return int(found[1]) if found else None
