"""Files copied between a run directory and the store by descriptor, never through a link a worker planted.

Workers write the run directory; the master holds the store's keys and reads its own files. So an upload walks a
directory opened without following links (:func:`os.fwalk` from a descriptor) and opens each file ``O_NOFOLLOW``
relative to the directory it was listed in, then copies what it opened: a file swapped for a link after it was
listed is refused, not read through, and anything but a regular file is left out and logged. A download creates
each directory and file relative to a directory it opened so, each file new (``O_EXCL``): a link planted in its
way fails the download instead of being written through.

Usage::

    >>> with opened_directory(Path("runs/r1/checkpoint-200")) as checkpoint:
    ...     upload_tree(store, checkpoint, ("checkpoint-200",))
    48213504
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path, PurePosixPath

from textsql.errors import StoreError
from textsql.store.location import Store
from worker.files import UnsafePath, UnsafeRead, open_regular, opened_directory

logger = logging.getLogger(__name__)

# Bytes read or written at a time: a shard is streamed, never held whole.
COPY_CHUNK_BYTES = 8 * 2**20
# A downloaded file as the trainer's own files are (the umask applies): the ranks load it whatever their user.
DOWNLOADED_FILE_MODE = 0o666


def upload_tree(store: Store, directory: int, prefix: tuple[str, ...], leave_out: Collection[str] = ()) -> int:
    """Copy the regular files under the directory ``directory`` to ``prefix`` in the store, at the same paths.

    :param directory: a descriptor of the directory (:func:`worker.files.opened_directory`).
    :param prefix: where it goes, below the store's root.
    :param leave_out: names of files directly in ``directory`` that are not copied.
    :returns: the bytes copied.
    :rtype: int
    """
    copied = 0
    # fwalk opens each subdirectory relative to its parent and compares it with what it listed: a link is not entered.
    for folder, _, names, folder_fd in os.fwalk(".", dir_fd=directory):
        parts = (*prefix, *PurePosixPath(folder).parts)
        for name in sorted(names):
            if folder != "." or name not in leave_out:
                copied += upload_file(store, folder_fd, (*parts, name))
    return copied


def upload_file(store: Store, directory: int, parts: tuple[str, ...]) -> int:
    """Copy the regular file ``parts[-1]`` of the directory ``directory`` to ``parts`` in the store; a link or
    anything but a regular file is left out and logged.

    :returns: the bytes copied.
    :rtype: int
    :raises FileNotFoundError: when the file is gone (the trainer rotated its checkpoint away).
    """
    shown = "/".join(parts)
    try:
        source = open_regular(parts[-1], dir_fd=directory)
    except UnsafeRead:
        logger.warning("checkpoint store: %s is not a regular file; not uploaded", shown)
        return 0
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        logger.warning("checkpoint store: %s is a symbolic link; not uploaded", shown)
        return 0
    with source, store.fs.open(store.path(*parts), "wb") as target:
        shutil.copyfileobj(source, target, COPY_CHUNK_BYTES)
        return source.tell()


def upload_subdirectory(store: Store, directory: int, name: str) -> int:
    """:func:`upload_tree` of the subdirectory ``name`` of ``directory`` to ``name`` in the store; nothing when it
    is missing, and nothing but a logged line when it is a link or not a directory.

    :returns: the bytes copied.
    :rtype: int
    """
    try:
        with opened_directory(Path(name), dir_fd=directory) as subdirectory:
            return upload_tree(store, subdirectory, (name,))
    except FileNotFoundError:
        return 0
    except UnsafePath:
        logger.warning("checkpoint store: %s is a symbolic link or not a directory; not uploaded", name)
        return 0


def download_tree(store: Store, source: str, directory: int) -> int:
    """Copy every object under ``source`` in the store into the directory ``directory``, at the same paths, each
    directory and file made relative to its parent's descriptor and each file new.

    :param directory: a descriptor of a directory this process made (:func:`worker.files.opened_directory`).
    :returns: the bytes copied.
    :rtype: int
    :raises FileExistsError: when something is already where a file goes (a worker's link included).
    :raises worker.files.UnsafePath: when a link is where a directory goes.
    :raises StoreError: for an object whose path no file may have (an empty, ``.`` or ``..`` part).
    """
    copied = 0
    with contextlib.ExitStack() as opened:
        folders: dict[tuple[str, ...], int] = {(): directory}
        for found in sorted(store.fs.find(source)):
            *folder, name = _parts_below(store, found, source)
            copied += _download_file(store, found, _made_folder(folders, tuple(folder), opened), name)
    return copied


def _parts_below(store: Store, found: str, source: str) -> list[str]:
    parts = found.removeprefix(source.rstrip("/") + "/").split("/")
    if not found.startswith(source.rstrip("/") + "/") or any(part in ("", ".", "..") for part in parts):
        raise StoreError(f"checkpoint store {store.where()}: {found!r} is not a path a checkpoint's file may have")
    return parts


def _made_folder(folders: dict[tuple[str, ...], int], parts: tuple[str, ...], opened: contextlib.ExitStack) -> int:
    """The descriptor of ``parts`` below the download's directory, made and opened (not through a link) once."""
    if parts not in folders:
        parent = _made_folder(folders, parts[:-1], opened)
        with contextlib.suppress(FileExistsError):
            os.mkdir(parts[-1], dir_fd=parent)
        folders[parts] = opened.enter_context(opened_directory(Path(parts[-1]), dir_fd=parent))
    return folders[parts]


def _download_file(store: Store, found: str, directory: int, name: str) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with (
        os.fdopen(os.open(name, flags, DOWNLOADED_FILE_MODE, dir_fd=directory), "wb") as target,
        store.fs.open(found, "rb") as source,
    ):
        shutil.copyfileobj(source, target, COPY_CHUNK_BYTES)
        return target.tell()
