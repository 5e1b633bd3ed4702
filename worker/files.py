"""Run-dir files: writes all at once (a reader sees the old file or the new one, never half of one),
logs only their owner can read, and the last line of a log."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that gives the file mode 0600, a file that already exists included.

    Run logs carry hosts, commands and whatever a rank prints: like the run's other files, they are
    for the user who started the run. Usage: ``open(path, "a", opener=private_opener)``.

    :rtype: int
    """
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def atomic_write(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to a temp file beside ``path`` with ``mode``, then rename it over ``path``.

    The temp file is created with ``mode`` from the start, so a secret is never readable by others.

    :param path: the final path.
    :param text: the whole content.
    :param mode: permission bits of the final file.
    :rtype: pathlib.Path
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def last_line(path: Path) -> str:
    """The last non-blank line of a log, to quote why a process stopped (``"no output"`` when empty).

    :param path: a text file that exists (undecodable bytes are replaced: a crash can cut a character in half).
    :rtype: str
    """
    lines = Path(path).read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"
