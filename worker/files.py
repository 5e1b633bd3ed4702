"""Run-dir files: writes all at once (a reader sees the old file or the new one, never half of one),
logs only their owner can read, the run directory only its owner can enter, and the last line of a log.

Nothing here follows a link planted where a file goes: a log is opened with ``O_NOFOLLOW`` and must be
a regular file with one name (not a hard link to a file elsewhere); a whole-file write goes to a new
temp file (``O_EXCL``) renamed over the path, which replaces a link instead of writing through it; a read of
what a worker may have written (:func:`read_bounded`, :func:`open_regular`) refuses a link, anything but a regular
file, and more than a limit. Nor does a write follow a link planted as the directory it goes into: logs and
whole-file writes open their parent directory with ``O_NOFOLLOW`` (:func:`parent_directory`) and create the file
relative to it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from worker.errors import WorkerError

logger = logging.getLogger(__name__)


class UnsafePath(WorkerError):
    """A path the run writes is a link or not a regular file: someone may have planted it to redirect the write."""


def open_directory(path: Path, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``path``, refused if ``path`` itself is a symbolic link (``O_NOFOLLOW``).

    Files are then created or read relative to it (``dir_fd``): whatever a worker renames or links meanwhile,
    they land in the directory that was opened, never in one a link names.

    :param path: the directory (relative to ``dir_fd`` when given).
    :param dir_fd: the directory ``path`` is relative to (None: the current one).
    :rtype: int
    :raises UnsafePath: if ``path`` is a symbolic link or not a directory, naming it and what to remove.
    :raises FileNotFoundError: when nothing is there.
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        kind = "a symbolic link" if _is_link(path, dir_fd) else "not a directory"
        raise UnsafePath(f"refusing to use {path}: it is {kind}; remove it and start again") from None


@contextlib.contextmanager
def opened_directory(path: Path, dir_fd: int | None = None) -> Iterator[int]:
    """:func:`open_directory`, closed after the ``with`` block.

    :rtype: typing.Iterator[int]
    :raises UnsafePath: if ``path`` is a symbolic link or not a directory.
    """
    fd = open_directory(path, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def parent_directory(path: Path) -> contextlib.AbstractContextManager[int]:
    """:func:`opened_directory` of ``path``'s parent: where a file of the run directory is created.

    :rtype: contextlib.AbstractContextManager[int]
    :raises UnsafePath: if the parent is a symbolic link (a worker's, planted to redirect the write).
    """
    return opened_directory(Path(path).parent)


def _is_link(name: str | Path, dir_fd: int | None) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    return False


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that gives the file mode 0600, a file that already exists included.

    Run logs carry hosts, commands and whatever a rank prints: like the run's other files, they are
    for the user who started the run. Usage: ``open(path, "a", opener=private_opener)``.

    A symbolic link at ``path`` is refused (``O_NOFOLLOW``), as is one planted as its parent directory, and so
    is anything that is not a regular file with a single name: a planted link must not make another file 0600
    and append to it.

    :rtype: int
    :raises UnsafePath: naming the path and what to remove.
    """
    name = Path(path).name
    with parent_directory(Path(path)) as parent:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
        except OSError as error:
            if _is_link(name, parent):
                raise UnsafePath(
                    f"refusing to write {path}: it is a symbolic link; remove it and start again"
                ) from None
            raise error from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
        os.close(fd)
        raise UnsafePath(f"refusing to write {path}: it is not a regular file with one name; remove it and start again")
    os.fchmod(fd, 0o600)
    return fd


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if needed and make it 0700: only its owner may list or enter it.

    :param path: a directory this user owns (a run directory).
    :rtype: pathlib.Path
    :raises UnsafePath: if ``path`` is a symbolic link or not a directory.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = path.lstat()
    if not stat.S_ISDIR(status.st_mode):
        raise UnsafePath(f"refusing to use {path} as a run directory: it is a link or not a directory; pick another")
    path.chmod(0o700)
    return path


def atomic_write(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to a temp file beside ``path`` with ``mode``, then rename it over ``path``.

    The temp file is new (``O_EXCL``, 0600 from the start, so a secret is never readable by others) and
    the rename replaces whatever is at ``path``, a symbolic link included, without following it. Both happen
    in the parent directory opened without following a link (:func:`parent_directory`): a worker's link planted
    as the parent is refused, so the write never replaces a file elsewhere.

    :param path: the final path.
    :param text: the whole content.
    :param mode: permission bits of the final file.
    :rtype: pathlib.Path
    :raises UnsafePath: if the parent directory is a symbolic link.
    """
    path = Path(path)
    with parent_directory(path) as parent:
        temp = f".{path.name}.{secrets.token_hex(8)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path.name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=parent)
            raise
    return path


class UnsafeRead(WorkerError):
    """A file to read is not a regular file or is larger than the reader allows (a link raises ``OSError``)."""


def read_bounded(path: Path | str, limit: int, dir_fd: int | None = None) -> bytes:
    """A regular file's bytes, at most ``limit`` of them.

    :param path: the file; a symbolic link there is refused (``O_NOFOLLOW``), a pipe never waited on.
    :param limit: the most bytes the reader takes.
    :param dir_fd: the directory ``path`` is relative to (an :func:`open_directory`; None: the current one).
    :rtype: bytes
    :raises FileNotFoundError: when nothing is there.
    :raises OSError: with ``errno.ELOOP`` for a symbolic link.
    :raises UnsafeRead: for anything but a regular file, or one larger than ``limit``.
    """
    with open_regular(path, dir_fd) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnsafeRead(f"{str(path)!r} is larger than {limit} bytes")
    return data


def open_regular(path: Path | str, dir_fd: int | None = None) -> BinaryIO:
    """A regular file opened for reading: never through a symbolic link at ``path``, never waiting on a pipe.

    :param path: the file.
    :param dir_fd: the directory ``path`` is relative to (an :func:`open_directory`; None: the current one).
    :rtype: BinaryIO
    :raises FileNotFoundError: when nothing is there.
    :raises OSError: with ``errno.ELOOP`` for a symbolic link.
    :raises UnsafeRead: for anything but a regular file.
    """
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    handle = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        handle.close()
        raise UnsafeRead(f"{str(path)!r} is not a regular file")
    return handle


def last_line(path: Path) -> str:
    """The last non-blank line of a log, to quote why a process stopped (``"no output"`` when empty).

    :param path: a text file that exists (undecodable bytes are replaced: a crash can cut a character in half).
    :rtype: str
    """
    lines = Path(path).read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"
